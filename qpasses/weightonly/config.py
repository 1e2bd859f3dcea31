"""The ``weight_only`` config block (``mode: weight_only``): checked like the rest of the config."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import _Problems, _boolean, _build, _number


WEIGHT_ONLY_ALGORITHMS = ("rtn", "hqq", "gptq", "awq")
WEIGHT_ONLY_FORMATS = ("qdq", "matmulnbits")
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
        problems.raise_if_any()


def build(data: dict) -> WeightOnlyConfig:
    """A WeightOnlyConfig from a mapping (onnxruntime spellings accepted); ConfigError lists every problem."""
    problems = _Problems()
    config = _build(WeightOnlyConfig, {_WEIGHT_ONLY_ALIASES.get(k, k): v for k, v in data.items()},
                    "weight_only.", problems)
    problems.raise_if_any()
    return config
