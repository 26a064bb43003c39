"""onnx_import.model_checks: what onnxruntime refuses is refused before import, with the file and the node,
tensor or opset named; what onnxruntime takes still imports."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import tvmdm
from onnx_import.model_checks import NEWEST_OPSET, OLDEST_OPSET


def _model(nodes, initializers=(), opset=17, output_shape=(2, 4), outputs=("y",)):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, output_shape) for o in outputs],
                              initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _ort_refuses(model):
    """onnxruntime refuses the model, when the session is made or when it runs."""
    with pytest.raises(Exception):
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        session.run(None, {"x": np.zeros((2, 4), np.float32)})


def test_two_nodes_writing_one_tensor_are_refused_naming_both():
    model = _model([helper.make_node("Relu", ["x"], ["y"], name="first"),
                    helper.make_node("Neg", ["x"], ["y"], name="second")])
    _ort_refuses(model)
    with pytest.raises(tvmdm.ModelLoadError, match="tensor 'y' is written by node 'first' and again by node 'second'"):
        tvmdm.compile(model)


@pytest.mark.parametrize("opset", [NEWEST_OPSET + 1, 99])
def test_an_opset_newer_than_any_known_is_refused(opset):
    model = _model([helper.make_node("Relu", ["x"], ["y"])], opset=opset)
    _ort_refuses(model)
    with pytest.raises(tvmdm.ModelLoadError, match=rf"opset {opset} is newer than any this installation knows "
                                                   rf"\(opsets {OLDEST_OPSET} to {NEWEST_OPSET} are supported\)"):
        tvmdm.compile(model)


def test_an_opset_older_than_numpy_broadcasting_is_refused_with_the_way_out():
    model = _model([helper.make_node("Relu", ["x"], ["y"])], opset=6)
    with pytest.raises(tvmdm.ModelLoadError, match=r"opset 6 is older than the oldest supported, 7: convert it with "
                                                   r"onnx.version_converter"):
        tvmdm.compile(model)


def _short(name, dims, count, raw=True):
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims)
    if raw:
        tensor.raw_data = np.zeros(count, np.float32).tobytes()
    else:
        tensor.float_data.extend([0.0] * count)
    return tensor


@pytest.mark.parametrize("raw, message", [
    (True, r"initializer 'w' of shape \[2, 4\] needs 32 bytes of data but holds 12"),
    (False, r"initializer 'w' of shape \[2, 4\] needs 8 values of data but holds 3"),
])
def test_an_initializer_shorter_than_its_shape_is_refused_by_name(raw, message):
    model = _model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], [_short("w", [2, 4], 3, raw)])
    with pytest.raises(tvmdm.ModelLoadError, match=message):
        tvmdm.compile(model)


def test_external_data_shorter_than_the_tensor_names_tensor_and_file(tmp_path):
    weights = helper.make_tensor("w", TensorProto.FLOAT, [64, 32], np.ones(64 * 32, np.float32).tobytes(), raw=True)
    model = _model([helper.make_node("MatMul", ["x2", "w"], ["y"], name="mm")], [weights], output_shape=(2, 32))
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x2", TensorProto.FLOAT, [2, 64]))
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.data", size_threshold=0)
    data = tmp_path / "m.data"
    data.write_bytes(data.read_bytes()[:1000])  # a copy cut short
    with pytest.raises(tvmdm.ModelLoadError, match=rf"{tmp_path / 'm.onnx'}: .*'w'"):
        tvmdm.compile(str(tmp_path / "m.onnx"))


def test_inconsistent_shapes_are_refused_as_the_checker_refuses_them():
    # y declared [3, 5], but Relu of a [2, 4] input is [2, 4]: strict shape inference (onnxruntime too) refuses
    model = _model([helper.make_node("Relu", ["x"], ["y"], name="relu")], output_shape=(3, 5))
    with pytest.raises(tvmdm.ModelLoadError, match=r"invalid ONNX model \(onnx's checker, as onnxruntime\): .*relu"):
        tvmdm.compile(model)


def test_outputs_of_unknown_rank_still_compile_as_onnxruntime_runs_them():
    model = _model([helper.make_node("Relu", ["x"], ["y"])], output_shape=None)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(tvmdm.compile(model).run({"x": x})[0], expected[0])


@pytest.mark.parametrize("epsilon", [-1.0, float("nan")])
def test_an_attribute_onnxruntime_refuses_is_refused_by_node(epsilon):
    # onnxruntime fuses the layer's Add + LayerNormalization into SkipLayerNorm, which refuses the epsilon
    from tests.helpers.fuzz import feeds

    model = tvmdm.default_model("bert-tiny-layer")
    node = next(n for n in model.graph.node if n.op_type == "LayerNormalization")
    next(a for a in node.attribute if a.name == "epsilon").f = epsilon
    with pytest.raises(Exception, match="epsilon"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds())
    with pytest.raises(tvmdm.ModelLoadError, match=rf"node '{node.name}' \(LayerNormalization\): attribute "
                                                   r"epsilon = .* must be a finite number >= 0"):
        tvmdm.compile(model)
