"""The checks onnxruntime makes before it runs a model, made before TVM's frontend sees it.

TVM's frontend trusts its input: a model onnxruntime refuses (two nodes writing one tensor, an opset newer
than any operator set known here, an initializer whose data is shorter than its shape) compiled without a
word, or failed deep inside numpy. Each is refused here with the file and the node, tensor or opset named.
"""
from __future__ import annotations

import math

import onnx
from onnx import helper

from tvmdm.core.errors import ModelLoadError

# Opset 7 brought numpy-style broadcasting, which TVM's frontend assumes; the newest opset is the one the
# installed onnx package defines (onnxruntime refuses newer ones too: an operator's meaning may have changed).
OLDEST_OPSET = 7
NEWEST_OPSET = onnx.defs.onnx_opset_version()
_DEFAULT_DOMAINS = ("", "ai.onnx")
_SUB_BYTE = {getattr(onnx.TensorProto, name) for name in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
             if hasattr(onnx.TensorProto, name)}  # packed several to a byte
_PROTO_LIMIT = 2**31 - 1  # protobuf's message limit: larger models are checked from their file


def check_model(proto: onnx.ModelProto, label: str, path: str | None = None) -> None:
    """Raise ModelLoadError naming what onnxruntime would refuse in ``proto`` (its data already loaded)."""
    check_opset(proto, label)
    check_initializer_sizes(proto, label)
    check_attributes(proto, label)
    large = proto.ByteSize() > _PROTO_LIMIT
    if large and path is None:
        return  # too large to hand to the checker in memory, and no file to check instead
    try:
        if not large and _io_without_shape(proto):
            # onnxruntime takes graph inputs/outputs of unknown rank; the checker wants a shape: check the
            # copy shape inference fills in (strict: the same consistency the full check asks for)
            proto = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
            if _io_without_shape(proto):
                return  # an output of an operator onnx does not know (a custom domain's): the importer decides
        onnx.checker.check_model(path if large else proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        detail = " ".join(str(err).split())
        raise ModelLoadError(f"{label}: invalid ONNX model (onnx's checker, as onnxruntime): {detail}") from None


def _io_without_shape(proto: onnx.ModelProto) -> bool:
    return any(v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape")
               for v in list(proto.graph.input) + list(proto.graph.output))


# Attribute values onnxruntime refuses at session creation that TVM's converters take without a word.
_NORMALIZATIONS = ("LayerNormalization", "BatchNormalization", "InstanceNormalization", "GroupNormalization")
ATTRIBUTE_RULES = {(op, "epsilon"): (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
                   for op in _NORMALIZATIONS}


def check_attributes(proto: onnx.ModelProto, label: str) -> None:
    for node in proto.graph.node:
        for attr in node.attribute:
            rule = ATTRIBUTE_RULES.get((node.op_type, attr.name))
            if rule and not rule[0](helper.get_attribute_value(attr)):
                raise ModelLoadError(f"{label}: node {node.name or node.op_type!r} ({node.op_type}): attribute "
                                     f"{attr.name} = {helper.get_attribute_value(attr)} must be {rule[1]}")


def check_opset(proto: onnx.ModelProto, label: str) -> None:
    versions = [o.version for o in proto.opset_import if o.domain in _DEFAULT_DOMAINS]
    if not versions:
        raise ModelLoadError(f"{label}: the model imports no version of the default ONNX operator set")
    version = max(versions)
    if version > NEWEST_OPSET:
        raise ModelLoadError(f"{label}: opset {version} is newer than any this installation knows (opsets "
                             f"{OLDEST_OPSET} to {NEWEST_OPSET} are supported): export it with an older opset")
    if version < OLDEST_OPSET:
        raise ModelLoadError(f"{label}: opset {version} is older than the oldest supported, {OLDEST_OPSET}: "
                             f"convert it with onnx.version_converter.convert_version(model, {OLDEST_OPSET}) or newer")


def check_initializer_sizes(proto: onnx.ModelProto, label: str) -> None:
    """Every initializer holds as many values as its shape says (raw bytes or typed fields)."""
    for tensor in proto.graph.initializer:
        if any(d < 0 for d in tensor.dims):
            raise ModelLoadError(f"{label}: initializer {tensor.name!r} has a negative dimension {list(tensor.dims)}")
        want, have, unit = _stored_size(tensor)
        if have is not None and have != want:
            raise ModelLoadError(f"{label}: initializer {tensor.name!r} of shape {list(tensor.dims)} needs {want} "
                                 f"{unit} of data but holds {have} (truncated raw_data or external data file?)")


def _stored_size(tensor: onnx.TensorProto) -> tuple[int, int | None, str]:
    """(needed, held, unit) for the tensor's data; held is None where the size cannot be told simply (strings,
    sub-byte and complex types, data that is still external). Typed fields hold one value per element (fp16 and
    bf16 included, one per int32)."""
    count = math.prod(tensor.dims)
    if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.data_type in (
            onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED, onnx.TensorProto.COMPLEX64,
            onnx.TensorProto.COMPLEX128):
        return count, None, "values"
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return count, None, "values"
    if tensor.data_type in _SUB_BYTE:
        return count, None, "values"
    if tensor.HasField("raw_data"):
        return count * itemsize, len(tensor.raw_data), "bytes"
    field = helper.tensor_dtype_to_field(tensor.data_type)
    return count, len(getattr(tensor, field)), "values"
