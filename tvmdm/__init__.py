"""tvmdm: BERT training and inference on Apache TVM, made fast by cutting data movement.

Public API:
    compile(model, *, target="llvm", shapes=None, tuning_logs="shipped", fusion="paper", layout="bshd",
            precision="fp32" | "bf16" (CPU, AVX512-BF16) | "fp16" (CUDA)) -> Compiled
    load(path) -> runner of an exported artifact (no onnx needed)
    analyze(model_or_compiled, fusion=, shapes=, measure=) -> Report: per-kernel flops / bytes / class
    default_model(name), default_dims(name): the embedded BERT models (ONNX, seeded weights)
    random_inputs(compiled, batch=, seq=): synthetic inputs for any compiled or loaded model
    compile_train_step(model, loss=, optimizer=AdamW(...), batch=, seq=) -> TrainStep: forward + loss +
        backward + AdamW compiled into one step; load_train_step(path) resumes an exported one;
        DataParallel(step) averages its gradients over a torch.distributed group; precision="bf16" / "fp16"
        and LossScaler (dynamic loss scaling) for mixed-precision training
"""
from tvmdm.core.threads import use_all_cores as _use_all_cores

_use_all_cores()  # before any TVM kernel runs: the thread pool reads it once

import importlib  # noqa: E402

from tvmdm.runtime.artifact import load
from tvmdm.core.errors import ArtifactError, InputError, ModelLoadError, ShapeError, TargetError, TvmdmError, UnsupportedOperatorError
from tvmdm.runtime.inputs import random_inputs
from tvmdm.core.spec import TensorSpec

# The rest is imported on first use: loading and running an artifact needs TVM's runtime alone (the compiler,
# Relax and onnx stay unloaded; see tvmdm.runtime), and the model builder needs onnx.
_LAZY = {
    "tvmdm.analysis.report": ("Report", "analyze"),
    "tvmdm.build.compiled": ("Compiled", "compile"),
    "tvmdm.build.check": ("CheckResult",),
    "tvmdm.core.options": ("Options",),
    "tvmdm.core.extras": ("MissingExtraError",),
    "tvmdm.train.distributed": ("DataParallel",),
    "tvmdm.train.step": ("compile_train_step",),
    "tvmdm.runtime.train_step": ("TrainStep", "load_train_step"),  # runtime alone, like load
    "tvmdm.core.training": ("AdamW", "LossScaler"),
    "tvmdm.models": ("default_model", "default_dims", "DEFAULT_MODELS"),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}

__version__ = "0.1.0"  # pyproject.toml reads it from here

__all__ = [
    "compile", "load", "analyze", "Options", "compile_train_step", "load_train_step", "TrainStep", "AdamW", "LossScaler", "DataParallel", "Report", "Compiled", "CheckResult", "TensorSpec",
    "TvmdmError", "ModelLoadError", "UnsupportedOperatorError", "ShapeError", "TargetError", "InputError", "ArtifactError",
    "MissingExtraError", "default_model", "default_dims", "random_inputs", "DEFAULT_MODELS",
]


def __getattr__(name):
    if name in _HOME:
        value = globals()[name] = getattr(importlib.import_module(_HOME[name]), name)
        return value
    try:  # a submodule: tvmdm.models, tvmdm.bench, ...
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'tvmdm' has no attribute {name!r}")
