"""qpasses: a compiler-pass framework that turns float ONNX models into quantized QDQ models."""
from .api import quantize, quantize_static, run_pipeline
from .config.quant_config import QuantConfig, load_config
from .core.context import RunContext
from .core.pipeline import Pass, PassManager, PassResult, parse_pipeline, print_pipeline
from .core.registry import all_passes, register
from .errors import (CalibrationDataError, ConfigError, ModelError, PassFailure, PipelineError,
                     PreconditionError, QpassesError)
from .ir.annotations import Convert, QuantTable, TensorQuant
from .ir.model import QModel, load, save

__version__ = "0.1.0"
__all__ = [
    "CalibrationDataError", "ConfigError", "Convert", "ModelError", "Pass", "PassFailure",
    "PassManager", "PassResult", "PipelineError", "PreconditionError", "QModel", "QpassesError",
    "QuantConfig", "QuantTable", "RunContext", "TensorQuant", "all_passes", "load", "load_config", "parse_pipeline",
    "print_pipeline", "quantize", "quantize_static", "register", "run_pipeline", "save",
]
