"""The embedded default models: valid ONNX, compiled by tvmdm, matching onnxruntime at several shapes."""
import numpy as np
import onnx
import pytest

import tvmdm
from tvmdm import models


@pytest.mark.parametrize("name", sorted(models.DEFAULT_MODELS))
def test_default_models_are_valid_and_seeded(name):
    a, b = tvmdm.default_model(name), tvmdm.default_model(name)
    onnx.checker.check_model(a, full_check=True)
    assert a.SerializeToString() == b.SerializeToString()  # seeded: the same model every time
    assert [i.name for i in a.graph.input][:1] in (["hidden_states"], ["input_ids"])


def test_base_layer_shapes_and_parameter_count():
    model = tvmdm.default_model("bert-base-layer")
    weights = {t.name: list(t.dims) for t in model.graph.initializer
               if t.data_type == onnx.TensorProto.FLOAT and np.prod(t.dims) > 1}
    assert weights["layer.0.attention.self.query.weight"] == [768, 768]
    assert weights["layer.0.intermediate.dense.weight"] == [768, 3072]
    # BERT-base layer: 4 * (768*768 + 768) + 2 * 768*3072 + 3072 + 768 + 2 * 2 * 768 parameters
    assert sum(int(np.prod(d)) for d in weights.values()) == 4 * (768 * 768 + 768) + 2 * 768 * 3072 + 3072 + 768 + 4 * 768
    assert models.default_dims("bert-base-layer") == {"batch": 8, "seq": 128}


@pytest.mark.parametrize("name", ["bert-tiny-layer", "bert-small"])
def test_default_models_match_onnxruntime_at_two_shapes(name):
    compiled = tvmdm.compile(tvmdm.default_model(name))
    for batch, seq, seed in [(2, 8, 0), (3, 13, 1)]:
        feeds = tvmdm.random_inputs(compiled, batch=batch, seq=seq, seed=seed)
        result = compiled.check(feeds)
        assert result.ok, str(result)
        assert compiled.run(feeds)[0].shape[:2] == (batch, seq)


def test_base_layer_matches_onnxruntime_at_a_small_shape():
    # The real base-size weights, at a small (batch, seq) so untuned kernels stay fast.
    compiled = tvmdm.compile(tvmdm.default_model("bert-base-layer"))
    assert compiled.check(tvmdm.random_inputs(compiled, batch=1, seq=16)).ok


def test_padding_mask_changes_only_attention():
    # Masked positions must not influence unmasked ones: compare a padded row with the same row cut short.
    compiled = tvmdm.compile(tvmdm.default_model("bert-tiny-layer"))
    feeds = tvmdm.random_inputs(compiled, batch=2, seq=8)
    feeds["attention_mask"][:] = 1
    feeds["attention_mask"][0, 5:] = 0
    full = compiled.run(feeds)[0]
    short = compiled.run({"hidden_states": feeds["hidden_states"][:1, :5],
                          "attention_mask": feeds["attention_mask"][:1, :5]})[0]
    np.testing.assert_allclose(full[0, :5], short[0], rtol=1e-5, atol=1e-5)


def test_no_fusion_gives_the_same_numbers(tiny_layer):
    fused = tvmdm.compile(tiny_layer, fusion="tvm")
    unfused = tvmdm.compile(tiny_layer, fusion="none")
    feeds = tvmdm.random_inputs(fused)
    np.testing.assert_allclose(fused.run(feeds)[0], unfused.run(feeds)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown fusion level 'max'"):
        tvmdm.compile(tiny_layer, fusion="max")


def test_shared_initializer_is_reported():
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="/q"), helper.make_node("MatMul", ["x", "w"], ["b"], name="/k"),
             helper.make_node("Add", ["a", "b"], ["y"], name="/add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], initializer=[w])
    compiled = tvmdm.compile(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert compiled.imported.shared_initializers == {"w": ["/q", "/k"]}
    assert tvmdm.compile(tvmdm.default_model("bert-small")).imported.shared_initializers == {}


def test_compile_a_relax_irmodule(tiny_layer):
    # A user's own Relax module: main(inputs..., weights...) with the weights given as params.
    from onnx_import import import_onnx

    imported = import_onnx(tiny_layer)
    from_onnx = tvmdm.compile(tiny_layer)
    compiled = tvmdm.compile(imported.mod, params=imported.params)
    assert [s.shape for s in compiled.inputs] == [("batch", "seq", 32), ("batch", "seq")]
    assert compiled.output_names == ["output_0"]
    feeds = tvmdm.random_inputs(compiled, batch=2, seq=5)
    np.testing.assert_allclose(compiled.run(feeds)[0], from_onnx.run(feeds)[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(tvmdm.TvmdmError, match="compiled from an IRModule"):
        compiled.check(feeds)
    with pytest.raises(tvmdm.ShapeError, match="trailing parameters"):
        tvmdm.compile(imported.mod, params={"w": np.zeros(3, np.float32)})
