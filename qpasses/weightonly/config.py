"""The ``weight_only`` config block (``mode: weight_only``): checked like the rest of the config."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config.checks import Problems as _Problems, boolean as _boolean, build as _build, number as _number


WEIGHT_ONLY_ALGORITHMS = ("rtn", "hqq", "gptq", "awq")
WEIGHT_ONLY_FORMATS = ("qdq", "matmulnbits")
WEIGHT_ONLY_SCHEMES = ("int", "mxint8", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4")   # mx*: weightonly/mx.py
MX_BITS = {"mxint8": 8, "mxfp8_e4m3": 8, "mxfp8_e5m2": 8, "mxfp4": 4}
# onnxruntime's matmul_nbits_quantizer spellings
_WEIGHT_ONLY_ALIASES = {"default": "rtn", "qoperator": "matmulnbits", "quantformat.qoperator": "matmulnbits",
                        "quantformat.qdq": "qdq", "is_symmetric": "symmetric", "percdamp": "damping",
                        "actorder": "act_order", "nodes_to_exclude": "exclude", "quant_format": "format",
                        "algo": "algorithm"}


@dataclass
class WeightOnlyConfig:
    """``mode: weight_only``: MatMul/Gemm weights quantized per block along K (quantize-weights)."""

    bits: int = 4
    block_size: int = 32
    symmetric: bool = True          # hqq is asymmetric whatever this says (it optimises the zero point)
    algorithm: str = "rtn"
    format: str = "qdq"
    exclude: list = field(default_factory=list)   # node or weight names, or fnmatch patterns
    damping: float = 0.01           # gptq: fraction of the mean Hessian diagonal added to it
    act_order: bool = False         # gptq: columns in order of decreasing Hessian diagonal (static blocks)
    scheme: str = "int"             # int (bits, block_size, symmetric) or an MX format (block 32, power-of-two scales)

    def __post_init__(self):
        problems = _Problems()
        self.algorithm = _WEIGHT_ONLY_ALIASES.get(str(self.algorithm).lower(), str(self.algorithm).lower())
        self.format = _WEIGHT_ONLY_ALIASES.get(str(self.format).lower(), str(self.format).lower())
        if self.bits not in (4, 8) or isinstance(self.bits, bool):
            problems.append(f"weight_only.bits: expected 4 or 8, got {self.bits!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size < 16 or self.block_size & (self.block_size - 1):
            problems.append(f"weight_only.block_size: expected a power of two >= 16, got {self.block_size!r}")
        if self.algorithm not in WEIGHT_ONLY_ALGORITHMS:
            problems.append(f"weight_only.algorithm: {self.algorithm!r} is not one of {', '.join(WEIGHT_ONLY_ALGORITHMS)}")
        if self.format not in WEIGHT_ONLY_FORMATS:
            problems.append(f"weight_only.format: {self.format!r} is not one of {', '.join(WEIGHT_ONLY_FORMATS)}")
        if isinstance(self.exclude, (str, bytes)) or not isinstance(self.exclude, (list, tuple)) \
                or not all(isinstance(v, str) for v in self.exclude):
            problems.append(f"weight_only.exclude: expected a list of names or patterns, got {self.exclude!r}")
        else:
            self.exclude = list(self.exclude)
        self.damping = _number(problems, "weight_only.damping", self.damping, lambda v: 0 <= v <= 1, "a number in [0, 1]")
        for key in ("symmetric", "act_order"):
            _boolean(problems, self, key, "weight_only.")
        self.scheme = str(self.scheme).lower()
        if self.scheme not in WEIGHT_ONLY_SCHEMES:
            problems.append(f"weight_only.scheme: {self.scheme!r} is not one of {', '.join(WEIGHT_ONLY_SCHEMES)}")
        elif self.scheme != "int":
            problems.extend(_mx_conflicts(self))
            self.bits = MX_BITS[self.scheme]
        problems.raise_if_any()


def _mx_conflicts(cfg: WeightOnlyConfig) -> list[str]:
    """What an MX scheme (block 32, symmetric power-of-two scales, DequantizeLinear) cannot honour."""
    out, s = [], cfg.scheme
    if cfg.block_size != 32:
        out.append(f"weight_only.block_size: scheme {s} fixes blocks of 32, got {cfg.block_size!r}")
    if cfg.symmetric is not True:
        out.append(f"weight_only.symmetric: scheme {s} is symmetric (no zero point)")
    if cfg.format == "matmulnbits":
        out.append(f"weight_only.format: MatMulNBits holds integer codes, not {s}; use format: qdq")
    if cfg.algorithm == "hqq":
        out.append(f"weight_only.algorithm: hqq optimises a zero point, which {s} has not; use rtn, gptq or awq")
    return out


def build(data: dict) -> WeightOnlyConfig:
    """A WeightOnlyConfig from a mapping (onnxruntime spellings accepted); ConfigError lists every problem."""
    problems = _Problems()
    data = {_WEIGHT_ONLY_ALIASES.get(k, k): v for k, v in data.items()}
    scheme = str(data.get("scheme", "int")).lower()
    if scheme in MX_BITS and "bits" in data and data["bits"] != MX_BITS[scheme]:
        problems.append(f"weight_only.bits: scheme {scheme} has {MX_BITS[scheme]}-bit elements, got {data['bits']!r}")
    config = _build(WeightOnlyConfig, data, "weight_only.", problems)
    problems.raise_if_any()
    return config
