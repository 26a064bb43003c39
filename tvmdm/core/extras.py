"""Optional dependencies: the core install compiles and runs; tuning and plots need their extras.

``require(modules, extra, purpose)`` imports each module or raises ``MissingExtraError`` naming the pip
command, before any work starts (not a bare ModuleNotFoundError deep inside MetaSchedule after minutes)."""
from __future__ import annotations

import importlib

from tvmdm.core.errors import TvmdmError

# extra -> the modules it brings (pyproject.toml's optional-dependencies)
EXTRAS = {
    "tune": ("xgboost", "psutil", "cloudpickle"),  # MetaSchedule's cost model, its workers, their pickling
    "rpc": ("tornado", "psutil"),  # tuning with an RPC tracker (TVM's RPC server and tracker)
    "plot": ("matplotlib",),
}


class MissingExtraError(TvmdmError, ImportError):
    """An optional dependency this feature needs is not installed."""


def require(extra: str, purpose: str) -> None:
    missing = []
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise MissingExtraError(f"{purpose} needs {', '.join(missing)} (not installed): "
                                f"pip install 'tvmdm[{extra}]'")
