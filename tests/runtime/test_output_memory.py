"""Outputs handed over without a copy (tvmdm.build.output_memory, ModelRunner._host_array): a CPU module's
outputs are numpy views of the memory its call made, and only those; an output that is an input, a weight, a
constant, a view of one, or a repeat, is copied, so that no caller's write reaches the module or its inputs."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
import pytest

import tvmdm
from tvmdm.runtime.artifact import runner_manifest

OUTPUTS = ["relu", "exp_flat", "same_as_x", "x_flat", "weight", "relu_again", "relu_flat"]


def _model() -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "weight")
    shape = numpy_helper.from_array(np.array([6], dtype=np.int64), "flat")
    nodes = [helper.make_node("Relu", ["x"], ["relu"]),
             helper.make_node("Exp", ["x"], ["exp"]),
             helper.make_node("Reshape", ["exp", "flat"], ["exp_flat"]),  # a view of the call's memory
             helper.make_node("Identity", ["x"], ["same_as_x"]),
             helper.make_node("Reshape", ["x", "flat"], ["x_flat"]),  # a view of the input
             helper.make_node("Identity", ["relu"], ["relu_again"]),
             helper.make_node("Reshape", ["relu", "flat"], ["relu_flat"])]  # a view of an earlier output
    graph = helper.make_graph(
        nodes, "outputs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in OUTPUTS], [weight, shape])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def compiled():
    return tvmdm.compile(_model())


def test_only_memory_the_call_made_is_handed_over(compiled):
    assert compiled.output_names == OUTPUTS
    # the input, a view of it, the weight, the repeated output and a view of an earlier one are copied
    assert compiled.copied_outputs == [2, 3, 4, 5, 6]
    x = np.array([[-1, 2, -3], [4, -5, 6]], dtype=np.float32)
    first = compiled.run({"x": x})
    assert not first[0].flags.owndata and not first[1].flags.owndata  # views of the call's own memory
    assert all(first[i].flags.owndata for i in (2, 3, 4, 5, 6))
    for out in first:
        out[...] = 100  # the caller may write into every output ...
    second = compiled.run({"x": x})
    # ... and neither the input, nor the weight, nor the next call's outputs see it
    np.testing.assert_array_equal(x, [[-1, 2, -3], [4, -5, 6]])
    expected = [np.maximum(x, 0), np.exp(x).reshape(6), x, x.reshape(6),
                np.arange(6, dtype=np.float32).reshape(2, 3), np.maximum(x, 0), np.maximum(x, 0).reshape(6)]
    for got, want in zip(second, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert (first[0] == 100).all()  # and the next call did not write into the previous one's outputs


def test_the_artifact_keeps_which_outputs_are_copied(compiled, tmp_path):
    loaded = tvmdm.load(compiled.export(tmp_path / "m.tvmdm"))
    assert loaded.copied_outputs == [2, 3, 4, 5, 6]
    x = np.ones((2, 3), np.float32)
    assert not loaded.run({"x": x})[0].flags.owndata
    # an artifact written before the field: every output copied
    manifest = dict(runner_manifest(compiled))
    del manifest["copied_outputs"]
    from tvmdm.runtime.artifact import runner_from_parts

    old = runner_from_parts(manifest, compiled._executable, compiled.params(), "old.tvmdm")
    assert old.copied_outputs is None and all(o.flags.owndata for o in old.run({"x": x}))
