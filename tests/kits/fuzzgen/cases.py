"""``cases()``: a :class:`FuzzCase` (a drawn model, 4 calibration feeds and a config)."""
from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from hypothesis import strategies as st

from .configs import configs
from .models import feeds_for, models


@dataclass
class FuzzCase:
    """One fuzz example: the float model, its calibration feeds and the quantization config."""

    model: onnx.ModelProto
    feeds: list[dict]
    config: dict
    ops: list[str] = field(default_factory=list)
    traits: list[str] = field(default_factory=list)  # "scaled-feeds" (not N(0, 1)), "scaled-params"
    passes: str | None = None   # None: the default pipeline

    def __repr__(self) -> str:
        text = onnx.printer.to_text(self.model)
        passes = f", passes={self.passes!r}" if self.passes else ""
        return f"FuzzCase(config={self.config!r}, ops={self.ops!r}{passes}, model=\n{text}\n)"

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis prints falsifying examples with this
        printer.text(repr(self))


@st.composite
def cases(draw, min_ops: int = 1, max_ops: int = 16, four_bit: bool = False):
    """A :class:`FuzzCase`: model, 4 calibration feeds, config (``four_bit``: 4 bits somewhere in it)."""
    drawn = draw(models(min_ops, max_ops))
    config = draw(configs(drawn.activations, drawn.nodes, drawn.weights, four_bit=four_bit))
    specs = drawn.inputs
    scaled = draw(st.integers(0, 3)) == 3          # else every float input is N(0, 1)
    scales = {name: (draw(st.sampled_from((1.0, 0.01, 100.0, 0.0))), draw(st.sampled_from((0.0, 3.0, -3.0))))
              for name, (kind, _, _) in specs.items() if kind == "float" and scaled}
    feeds = feeds_for(specs, draw(st.integers(0, 2**16)), scales=scales)
    traits = ["scaled-feeds"] if any(v != (1.0, 0.0) for v in scales.values()) else []
    # 4 bits: half the time without search-precision, which may promote the 4-bit tensors away
    passes = WITHOUT_SEARCH if four_bit and draw(st.booleans()) else None
    return FuzzCase(drawn.model, feeds, config, drawn.ops, traits + ["scaled-params"] * drawn.scaled_params, passes)


WITHOUT_SEARCH = ("fold-constants,fold-batchnorm,cleanup,annotate-types,propagate-mixed-precision,calibrate,"
                  "select-by-snr,compute-qparams,correct-bias,fix-bias-scales,insert-qdq,insert-converts,cleanup")
