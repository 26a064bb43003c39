"""Each fix in onnx_import.frontend_fixes, with the stock converter shown still broken."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmdm
from onnx_import import frontend_fixes

frontend_fixes.patch_onnx_frontend()


def _from_onnx(model, **kw):
    from tvm import relax

    return relax.frontend.onnx.from_onnx(model, **kw)


@pytest.fixture
def stock_converter(monkeypatch):
    """Put one of TVM's original converters back for the duration of a test."""
    from tvm.relax.frontend.onnx import onnx_frontend

    def restore(name):
        monkeypatch.setattr(onnx_frontend, name, frontend_fixes.ORIGINAL_CONVERTERS[name])

    return restore


def _model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _constant_of_shape_model():
    # What torch's legacy exporter writes for a scalar: ConstantOfShape(shape=[]) with a (1,)-shaped value.
    value = numpy_helper.from_array(np.array([2.5], np.float32))
    nodes = [helper.make_node("ConstantOfShape", ["empty"], ["c"], value=value),
             helper.make_node("Mul", ["x", "c"], ["y"])]
    empty = numpy_helper.from_array(np.zeros((0,), np.int64), "empty")
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])], [empty])


def test_constant_of_shape_scalar_target(stock_converter):
    model = _constant_of_shape_model()
    compiled = tvmdm.compile(model)
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_allclose(compiled.run({"x": x})[0], 2.5 * x)
    stock_converter("ConstantOfShape")
    with pytest.raises(Exception, match="broadcast_to expects the input shape to have the number of ndim at least"):
        _from_onnx(model)


def _range_model():
    # Position ids as exports compute them: Range(0, Shape(x)[1], 1), added to a (batch, seq) tensor.
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "one"], ["n"], axis=0),
             helper.make_node("Range", ["zero", "n", "one"], ["r"]),
             helper.make_node("Add", ["x", "r"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(1, np.int64), "one")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.INT64, ["batch", "seq"])],
                  [helper.make_tensor_value_info("y", TensorProto.INT64, ["batch", "seq"])], inits)


def test_range_keeps_symbolic_extent(stock_converter):
    model = _range_model()
    compiled = tvmdm.compile(model)
    assert compiled.outputs[0].shape == ("batch", "seq")
    x = np.zeros((2, 5), np.int64)
    np.testing.assert_equal(compiled.run({"x": x})[0], np.arange(5)[None].repeat(2, 0))
    assert compiled.check({"x": x}).ok
    stock_converter("Range")
    stock = _from_onnx(model)
    assert str(stock["main"].ret_ty) == 'R.Tensor(dtype="int64", ndim=2)'  # data-dependent length: shape lost


def test_range_with_bound_extent_is_static(stock_converter):
    model = _range_model()
    compiled = tvmdm.compile(model, shapes={"x": [2, 5]})
    assert compiled.outputs[0].shape == (2, 5)
    stock_converter("Range")
    assert str(_from_onnx(model, shape_dict={"x": [2, 5]})["main"].ret_ty) == 'R.Tensor(dtype="int64", ndim=2)'


def test_expand_to_bound_shape(stock_converter):
    # Expand of a (2, n) tensor to the static Shape of x: TVM compares [2, n] with [2, 4] as Python lists.
    # (n = 1 at run time would need a runtime broadcast that TVM's broadcast_to does not do: n = 4 here.)
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Expand", ["m", "s"], ["e"]),
             helper.make_node("Add", ["x", "e"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
                           helper.make_tensor_value_info("m", TensorProto.FLOAT, [2, "n"])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    compiled = tvmdm.compile(model)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 4)).astype(np.float32), "m": rng.standard_normal((2, 4)).astype(np.float32)}
    np.testing.assert_allclose(compiled.run(feeds)[0], feeds["x"] + feeds["m"])
    assert compiled.check(feeds).ok
    stock_converter("Expand")
    with pytest.raises(Exception, match="Cannot use and / or / not operator to Expr"):
        _from_onnx(model)


def test_constants_become_constant_nodes():
    # With keep_params_in_input (weights as parameters) TVM makes shape constants parameters too, and Expand
    # then yields a data-dependent shape.
    nodes = [helper.make_node("Expand", ["x", "shape"], ["e"]), helper.make_node("MatMul", ["e", "w"], ["y"])]
    inits = [numpy_helper.from_array(np.array([2, 4], np.int64), "shape"),
             numpy_helper.from_array(np.ones((4, 3), np.float32), "w")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits)
    stock = _from_onnx(model, keep_params_in_input=True)
    assert str(stock["main"].ret_ty.shape) != "R.shape([2, 3])"
    fixed = frontend_fixes.constants_as_nodes(model)
    assert [t.name for t in fixed.graph.initializer] == ["w"]  # weights stay initializers (parameters)
    assert fixed.graph.node[0].op_type == "Constant" and fixed.graph.node[0].output[0] == "shape"
    assert [int(d) for d in _from_onnx(fixed, keep_params_in_input=True)["main"].ret_ty.shape.values] == [2, 3]
    assert list(model.graph.initializer[0].name) == list("shape")  # the caller's proto is untouched


def test_converter_errors_name_the_node():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="/my/reshape")]
    inits = [numpy_helper.from_array(np.array([7], np.int64), "shape")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    with pytest.raises(frontend_fixes.ConverterError, match=r"cannot convert Reshape node '/my/reshape' \(opset 17\)"):
        _from_onnx(frontend_fixes.constants_as_nodes(model), keep_params_in_input=True)
