"""A model named on a command line or in a benchmark -> the model and its input shapes."""
from __future__ import annotations

import os


def model_or_path(text: str):
    """A path to an ONNX file or artifact, or the name of an embedded default model."""
    from tvmdm import models

    if text in models.DEFAULT_MODELS and not os.path.exists(text):
        return models.default_model(text)
    return text


def resolve_shapes(model, shape_args, batch: int | None, seq: int | None, embedded_defaults: bool = True) -> dict | None:
    """--shape flags, plus (batch, seq) for every other input when --batch or --seq is given.
    An embedded model name with none of them gets its default (batch, seq) when ``embedded_defaults``
    (tune, analyze, bench: they measure one size; compile and run keep the dims symbolic)."""
    from onnx_import.importer import onnx_input_specs
    from onnx_import.loader import load_model_proto
    from tvmdm import models
    from tvmdm.runtime.inputs import bind_batch_seq

    shapes = dict(shape_args or [])
    if isinstance(model, str) and model in models.DEFAULT_MODELS and not os.path.exists(model) \
            and not shapes and batch is None and seq is None and embedded_defaults:
        batch, seq = models.default_dims(model)["batch"], models.default_dims(model)["seq"]
    if batch is None and seq is None:
        return shapes or None
    proto, _ = load_model_proto(model_or_path(model) if isinstance(model, str) else model)
    return bind_batch_seq(onnx_input_specs(proto), shapes, batch, seq)
