"""Synthetic inputs for a compiled model, from its input specs alone (works on loaded artifacts too)."""
from __future__ import annotations

import numpy as np

from tvmdm.core.errors import InputError


def concrete_shape(spec, dims: dict[str, int], batch: int, seq: int) -> list[int]:
    """Resolve symbolic dims: by name from ``dims``, else the first symbolic axis is batch, the next seq."""
    shape, symbolic_seen = [], 0
    for d in spec.shape:
        if isinstance(d, int):
            shape.append(d)
            continue
        if d in dims:
            shape.append(int(dims[d]))
        else:
            shape.append(batch if symbolic_seen == 0 else seq)
        symbolic_seen += 1
    return shape


def check_positive(name: str, value) -> None:
    """A size a user gave (batch, seq, steps): None (not given) or a whole number >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
        raise InputError(f"{name} must be a whole number >= 1, got {value!r}")


def bind_batch_seq(specs, shapes: dict, batch: int | None, seq: int | None) -> dict:
    """``shapes`` (input name -> shape) plus, for every other input, its shape with the symbolic axes set to
    (batch, seq) (1 where not given)."""
    for name, value in (("batch", batch), ("seq", seq)):
        check_positive(name, value)
    shapes = dict(shapes)
    for spec in specs:
        if spec.name not in shapes:
            shapes[spec.name] = concrete_shape(spec, {}, batch or 1, seq or 1)
    return shapes


def random_inputs(runner, *, batch: int = 2, seq: int = 8, dims: dict | None = None, seed: int = 0):
    """Inputs a BERT-like model accepts: token ids inside the embedding table, a padding mask that zeroes the
    tail of every other row (so masking is exercised), 0/1 token types, normal floats elsewhere."""
    check_positive("batch", batch)
    check_positive("seq", seq)
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in runner.inputs:
        shape = concrete_shape(spec, dims or {}, batch, seq)
        dtype = np.dtype(spec.dtype)
        if "mask" in spec.name:
            value = np.ones(shape, dtype=dtype)
            if len(shape) >= 2:
                value[1::2, ..., shape[-1] // 2 + 1:] = 0
        elif dtype.kind in "iu":
            high = 2 if "type" in spec.name else 100
            if spec.name in runner.index_bounds:
                high = min(high, runner.index_bounds[spec.name][0])
            value = rng.integers(0, high, size=shape).astype(dtype)
        else:
            value = rng.standard_normal(shape).astype(dtype)
        feeds[spec.name] = value
    return feeds
