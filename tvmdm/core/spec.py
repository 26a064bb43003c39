"""TensorSpec: what a model input or output looks like. Kept free of onnx so deployed artifacts load without it."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Name, shape (ints for fixed dims, names for symbolic ones) and dtype of a model input or output."""

    name: str
    shape: tuple
    dtype: str

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict) -> "TensorSpec":
        return cls(d["name"], tuple(d["shape"]), d["dtype"])
