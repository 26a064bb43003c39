"""Read an ONNX model from a path or a ModelProto and check it before TVM sees it.

TVM's frontend assumes a well-formed graph: a missing file, a truncated protobuf or an unknown operator
surfaces there as a bare traceback (or worse). Every such case is caught here with the file, node or op named;
then onnx_import.model_checks makes onnxruntime's checks.
"""
from __future__ import annotations

import os
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from onnx_import.model_checks import check_model
from tvmdm.core.errors import ModelLoadError


def load_model_proto(model: "str | os.PathLike | onnx.ModelProto") -> tuple[onnx.ModelProto, str]:
    """Return the ModelProto (external data loaded and confined to the model's folder) and a label for messages."""
    if isinstance(model, onnx.ModelProto):
        label = f"<ModelProto {model.graph.name or 'unnamed'}>"
        _check_structure(model, label)
        check_model(model, label)
        return model, label
    if not isinstance(model, (str, os.PathLike)):
        raise ModelLoadError(f"expected a path, an onnx.ModelProto or a tvm.IRModule, got {type(model).__name__}")
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as err:
        raise ModelLoadError(f"{path}: not a valid ONNX model (truncated or not ONNX): {err}") from None
    _check_structure(proto, str(path))
    _load_external_data(proto, path)
    check_model(proto, str(path), str(path))
    return proto, str(path)


def _check_structure(proto: onnx.ModelProto, label: str) -> None:
    # A truncated or foreign file can still decode into a (partial) ModelProto: check what must be there.
    if proto.ir_version < 3 or not proto.opset_import:
        raise ModelLoadError(f"{label}: not a valid ONNX model (no IR version or opset; truncated or not ONNX)")
    if not proto.graph.node or not proto.graph.output:
        raise ModelLoadError(f"{label}: the ONNX graph is empty (no nodes or no outputs; truncated file?)")
    known = {t.name for t in proto.graph.initializer} | {i.name for i in proto.graph.input} | {""}
    writers: dict[str, str] = {}
    for node in proto.graph.node:
        for name in node.output:
            if name and name in writers:
                raise ModelLoadError(f"{label}: tensor {name!r} is written by node {writers[name]!r} and again by "
                                     f"node {node.name or node.op_type!r}; a tensor has one writer (ONNX's SSA rule)")
            writers[name] = node.name or node.op_type
        for name in node.input:
            if name not in known:
                raise ModelLoadError(
                    f"{label}: node {node.name or node.op_type!r} ({node.op_type}) reads {name!r}, which no earlier "
                    "node, input or initializer produces (truncated file or unsorted graph)")
        known.update(node.output)
    for out in proto.graph.output:
        if out.name not in known:
            raise ModelLoadError(f"{label}: graph output {out.name!r} is never produced (truncated file?)")


def _load_external_data(proto: onnx.ModelProto, path: Path) -> None:
    base = path.parent.resolve()
    for tensor in external_data_helper._get_all_tensors(proto):
        if not external_data_helper.uses_external_data(tensor):
            continue
        info = external_data_helper.ExternalDataInfo(tensor)
        location = (base / info.location).resolve()
        if os.path.isabs(info.location) or not location.is_relative_to(base):
            raise ModelLoadError(
                f"{path}: initializer {tensor.name!r} points its external data at {info.location!r}, "
                f"outside the model's folder {base}; refusing to read it")
        if not location.is_file():
            raise ModelLoadError(f"{path}: external data file {info.location!r} of initializer "
                                 f"{tensor.name!r} not found in {base}")
    try:
        external_data_helper.load_external_data_for_model(proto, str(base))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path}: cannot read external data: {err}") from None
