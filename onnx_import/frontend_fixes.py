"""Fixes to TVM 0.27's ONNX frontend (tvm.relax.frontend.onnx), each with a regression test in
tests/onnx_import/test_frontend_fixes.py that shows the bug is still there in the frontend's own converter.

Pinned: apache-tvm==0.27.0.post1, apache-tvm-ffi==0.1.14.post1 (0.1.15.post2 segfaults in save_json).
"""
from __future__ import annotations

import numpy as np

_PATCHED = False

# The frontend's own converters, kept so the regression tests can show each bug is still there.
ORIGINAL_CONVERTERS: dict = {}


def _frontend():
    from tvm.relax.frontend.onnx import onnx_frontend

    return onnx_frontend


def _constant_of_shape_converter(base):
    """TVM's ConstantOfShape broadcasts the (1,)-shaped ``value`` tensor to the target shape, which fails
    for a 0-d target (``[]``), as in every BERT export by torch's legacy exporter: scalarize it first."""
    class ConstantOfShape(base):
        @classmethod
        def _impl_v9(cls, bb, inputs, attr, params):
            value = attr.get("value")
            if value is not None:
                array = _frontend().get_numpy(value)
                if array.size == 1 and array.ndim > 0:
                    attr = dict(attr, value=_scalar_tensor_proto(array))
            return super()._impl_v9(bb, inputs, attr, params)

    return ConstantOfShape


def _scalar_tensor_proto(array: np.ndarray):
    from onnx import numpy_helper

    return numpy_helper.from_array(array.reshape(()))


def _range_converter(base):
    """TVM's Range turns a limit that is a PrimExpr (the ``seq`` dim from ``Shape``, symbolic or bound)
    into a data-dependent ``range_len`` var, so position ids stop matching (batch, seq) and later shapes are
    lost. Emit ``relax.op.arange`` with that extent instead when start and delta are constants."""
    import tvm
    from tvm import relax

    def as_prim(x, params):
        x = _frontend().get_constant(x, params)
        if isinstance(x, tvm.ir.GenericConst):
            value = x.value.numpy()
            return int(value.reshape(-1)[0]) if value.size == 1 and value.dtype.kind in "iu" else None
        if tvm.ir.is_prim_expr(x):
            return x
        if isinstance(x, relax.Expr) and isinstance(x.ty, relax.ShapeType) and x.ty.values is not None:
            return x.ty.values[0] if len(x.ty.values) == 1 else None
        return None

    class Range(base):
        @classmethod
        def _impl_v12(cls, bb, inputs, attr, params):
            start, limit, delta = (as_prim(x, params) for x in inputs)
            if tvm.ir.is_prim_expr(limit) and isinstance(start, int) and isinstance(delta, int) and delta != 0:
                dtype = str(inputs[0].ty.dtype) if isinstance(inputs[0], relax.Expr) else "int64"
                return relax.op.arange(start, limit, delta, dtype)
            return super()._impl_v12(bb, inputs, attr, params)

    return Range


WEIGHT_DTYPES = (1, 10, 16)  # onnx.TensorProto FLOAT, FLOAT16, BFLOAT16


def is_weight(tensor) -> bool:
    """Float initializers with more than one element are model weights; everything else is a constant."""
    return tensor.data_type in WEIGHT_DTYPES and int(np.prod(tensor.dims)) > 1


def constants_as_nodes(proto):
    """With ``keep_params_in_input=True`` (needed to keep weights as parameters) TVM's frontend turns every
    initializer into a function parameter, and converters that do not look parameters up (Expand, ...)
    then treat shape constants as data: shapes become data-dependent and later Reshapes fail. Turn every
    initializer that is not a weight into a Constant node so the frontend sees it as a constant."""
    import onnx
    from onnx import helper

    out = onnx.ModelProto()
    out.CopyFrom(proto)
    graph = out.graph
    constants = [t for t in graph.initializer if not is_weight(t)]
    if not constants:
        return out
    keep = [t for t in graph.initializer if is_weight(t)]
    const_names = {t.name for t in constants}
    nodes = [helper.make_node("Constant", [], [t.name], name=f"tvmdm_const/{t.name}", value=t) for t in constants]
    nodes += list(graph.node)
    inputs = [i for i in graph.input if i.name not in const_names]
    del graph.initializer[:], graph.node[:], graph.input[:]
    graph.initializer.extend(keep)
    graph.node.extend(nodes)
    graph.input.extend(inputs)
    return out


def _expand_converter(base):
    """TVM's Expand compares two lists of PrimExprs with ``==`` when the target shape is a ShapeExpr, which
    raises "Cannot use and / or / not operator to Expr" once shapes are bound (legacy BERT exports with
    ``shapes=``). Same ONNX broadcasting, with a structural comparison."""
    import tvm_ffi
    from tvm import relax, tirx

    class Expand(base):
        @classmethod
        def _impl_v13(cls, bb, inputs, attr, params):
            data, shape = inputs[0], inputs[1]
            if not isinstance(shape, relax.ShapeExpr):
                return super()._impl_v13(bb, inputs, attr, params)
            target = list(shape.values)
            data_shape = [tirx.IntImm("int64", 1)] * (len(target) - data.ty.ndim) + list(data.ty.shape)
            # ONNX Expand broadcasts bidirectionally: a target dim of 1 (or -1) keeps the input's dim.
            out = [d if isinstance(t, tirx.IntImm) and t.value in (-1, 1) else t for d, t in zip(data_shape, target)]
            if len(out) == data.ty.ndim and all(tvm_ffi.structural_equal(a, b) for a, b in zip(out, data_shape)):
                return data
            return relax.op.broadcast_to(data, relax.ShapeExpr(out))

    return Expand


class ConverterError(Exception):
    """A converter failed on one node; the message names the op and the node."""


def _naming_convert_operator(original):
    """TVM's converter errors do not say which node failed (it prints the inputs to stdout instead):
    re-raise them naming the op and the node."""

    def convert_operator(self, op_name, inputs, attrs, opset):
        try:
            return original(self, op_name, inputs, attrs, opset)
        except Exception as err:  # noqa: BLE001 - any converter failure is reported the same way
            node = attrs.get("tvm_custom", {}).get("name", "?")
            first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            raise ConverterError(f"cannot convert {op_name} node {node!r} (opset {opset}): {first}") from err

    return convert_operator


def patch_onnx_frontend() -> None:
    """Install the converter fixes into TVM's ONNX frontend (idempotent).

    ``_get_convert_map`` reads the module-level converter classes on every call, so replacing the module
    attributes is enough; subclasses keep every other opset version of the original converters."""
    global _PATCHED
    if _PATCHED:
        return
    fe = _frontend()
    ORIGINAL_CONVERTERS.update(ConstantOfShape=fe.ConstantOfShape, Range=fe.Range, Expand=fe.Expand)
    fe.ConstantOfShape = _constant_of_shape_converter(fe.ConstantOfShape)
    fe.Range = _range_converter(fe.Range)
    fe.Expand = _expand_converter(fe.Expand)
    from onnx_import import contrib_ops  # onnxruntime's fused BERT ops, with its semantics

    fe.SkipLayerNormalization = contrib_ops.skip_layer_normalization(fe.SkipLayerNormalization)
    fe.EmbedLayerNormalization = contrib_ops.embed_layer_normalization(fe.EmbedLayerNormalization)
    fe.Attention = contrib_ops.attention(fe.Attention)
    fe.ONNXGraphImporter._convert_operator = _naming_convert_operator(fe.ONNXGraphImporter._convert_operator)
    _PATCHED = True
