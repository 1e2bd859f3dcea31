"""Error types. Every error a user can cause is a QpassesError with a one-line message."""


class QpassesError(Exception):
    """Base of every error caused by the user's input (CLI exit code 2)."""


class ModelError(QpassesError):
    """The model file or graph is unusable."""


class ConfigError(QpassesError):
    """The configuration or a tensor override is invalid."""


class CalibrationDataError(QpassesError):
    """Calibration data is missing, malformed or does not match the model."""


class PipelineError(QpassesError):
    """The pipeline text names an unknown pass or gives a bad option."""


class PreconditionError(QpassesError):
    """A pass was run before the facts it requires were established."""


class PassFailure(Exception):
    """An internal error inside a pass (CLI exit code 1); names the pass and the ones before it."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class TargetNotMet(QpassesError):
    """--require-target: the accuracy target could not be met (exit 3)."""


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it can cross processes (pickle), else an exception of the same name and text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return type(type(exc).__name__, (Exception,), {})(str(exc))
