"""The exceptions users see. Each message names the file, node, op, input or shape at fault."""


class TvmdmError(Exception):
    """Base class of every error tvmdm raises on purpose."""


class ModelLoadError(TvmdmError, ValueError):
    """The model file or proto cannot be read: missing, not ONNX, truncated, unsafe external data."""


class UnsupportedOperatorError(TvmdmError, NotImplementedError):
    """The ONNX graph uses an operator (or an operator form) that the importer cannot convert."""


class ShapeError(TvmdmError, ValueError):
    """Shapes given at compile time contradict the model."""


class InputError(TvmdmError, ValueError):
    """Inputs given to ``run`` do not match the compiled model: names, dtypes, ranks, dims or index ranges."""


class ArtifactError(TvmdmError, ValueError):
    """An exported artifact cannot be loaded."""


class TargetError(TvmdmError, ValueError):
    """An unknown or malformed compilation target."""


class Disagreement(TvmdmError, AssertionError):
    """A benchmarked system's outputs (or losses) disagree with the reference it is checked against."""


# Prefix of the message a compiled module's index guard raises (tvmdm.transform.index_guards); the runner turns
# such a failure into an InputError.
INDEX_GUARD_MARK = "tvmdm index guard: "
