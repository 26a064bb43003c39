"""Real transformers exports of every BERT family, both torch exporters, static and dynamic axes,
compiled by tvmdm and compared with onnxruntime."""
import numpy as np
import pytest

from tvmdm.models import hf_export as hf_exports
import tvmdm

pytestmark = pytest.mark.slow  # end to end, a minute or more in all (`pytest -m 'not slow'` skips it)

EXPORTS = [  # (exporter is dynamo, dynamic axes, opset)
    pytest.param(False, False, 14, id="legacy-static-op14"),
    pytest.param(False, True, 17, id="legacy-dynamic-op17"),
    pytest.param(True, False, 18, id="dynamo-static-op18"),
    pytest.param(True, True, 18, id="dynamo-dynamic-op18"),
]


@pytest.mark.parametrize("dynamo,dynamic,opset", EXPORTS)
@pytest.mark.parametrize("family", sorted(hf_exports.FAMILIES))
def test_export_matches_onnxruntime(hf_export, family, dynamo, dynamic, opset):
    compiled = tvmdm.compile(hf_export(family, dynamo=dynamo, dynamic=dynamic, opset=opset))
    result = compiled.check(hf_exports.sample_inputs(family))
    assert result.ok, str(result)
    symbolic = [d for spec in compiled.inputs for d in spec.shape if isinstance(d, str)]
    if not dynamic:
        assert not symbolic, compiled.inputs
        return
    # One compiled module, another (batch, seq): still matches.
    assert symbolic, compiled.inputs
    result = compiled.check(hf_exports.sample_inputs(family, batch=3, seq=5, seed=1))
    assert result.ok, str(result)
    first = compiled.run(hf_exports.sample_inputs(family, batch=3, seq=5))[0]
    assert first.shape[:2] == ((3, 3) if "seqcls" in family else (3, 5))  # logits are (batch, labels)


def test_binding_shapes_makes_them_static(hf_export):
    path = hf_export("bert", dynamo=False, dynamic=True, opset=17)
    compiled = tvmdm.compile(path, shapes={"input_ids": [2, 8], "attention_mask": [2, 8], "token_type_ids": [2, 8]})
    assert [s.shape for s in compiled.inputs] == [(2, 8)] * 3
    assert compiled.outputs[0].shape == (2, 8, 32)
    assert compiled.check(hf_exports.sample_inputs("bert")).ok
    with pytest.raises(tvmdm.InputError, match=r"input 'input_ids' axis 1 has size 5, the model was compiled for 8"):
        compiled.run(hf_exports.sample_inputs("bert", batch=2, seq=5))


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
def test_binding_one_input_binds_the_dims_it_shares(hf_export, dynamo):
    """The README's shapes={"input_ids": [8, 128]}: attention_mask and token_type_ids share (batch, seq) by name."""
    compiled = tvmdm.compile(hf_export("bert", dynamo=dynamo, dynamic=True, opset=17 + dynamo),
                             shapes={"input_ids": [2, 8]})
    assert [s.shape for s in compiled.inputs] == [(2, 8)] * 3
    assert compiled.check(hf_exports.sample_inputs("bert")).ok


def test_a_partial_binding_names_the_inputs_left_symbolic():
    """Dims with no name to share ("?") cannot follow a bound input: the error says which inputs need shapes."""
    model = tvmdm.default_model("bert-small")
    for value in model.graph.input:
        if value.name != "input_ids":
            for dim in value.type.tensor_type.shape.dim:
                dim.ClearField("dim_param")
    with pytest.raises(tvmdm.ShapeError, match=r"inputs 'attention_mask' \['\?', '\?'\], 'token_type_ids' "
                                               r"\['\?', '\?'\] keep symbolic dims that no bound input shares: "
                                               r"give their shapes too"):
        tvmdm.compile(model, shapes={"input_ids": [2, 8]})


def test_a_bound_sequence_past_the_position_table_says_so(hf_export):
    path = hf_export("bert", dynamo=False, dynamic=True, opset=17)  # 64 positions
    with pytest.raises(tvmdm.ShapeError, match=r"input 'input_ids' is bound to 128 tokens, but the position table "
                                               r"'.*position_embeddings.*' has 64 rows: sequences may be at most 64"):
        tvmdm.compile(path, shapes={"input_ids": [8, 128]})


def test_albert_shared_layers_are_reported(hf_export):
    # ALBERT shares one layer's weights across layers: every such weight is read by more than one node.
    compiled = tvmdm.compile(hf_export("albert", dynamo=False, dynamic=True, opset=17))
    shared = compiled.imported.shared_initializers
    assert shared and all(len(nodes) == 2 for nodes in shared.values()), shared
    bert = tvmdm.compile(hf_export("bert", dynamo=False, dynamic=True, opset=17))
    assert bert.imported.shared_initializers == {}


def test_dynamo_deduplicated_initializers_are_reported(tmp_path):
    # torch's dynamo exporter de-duplicates identical initializers: untouched LayerNorm biases (all zeros) of
    # different layers come out as one tensor.
    torch = pytest.importorskip("torch")
    model = hf_exports.tiny_model("bert")
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.output.LayerNorm.bias.zero_()
    feeds = {k: torch.from_numpy(v) for k, v in hf_exports.sample_inputs("bert").items()}
    path = str(tmp_path / "dedup.onnx")
    torch.onnx.export(model, (), path, kwargs=feeds, dynamo=True, external_data=False)
    compiled = tvmdm.compile(path)
    shared = compiled.imported.shared_initializers
    assert any(len(nodes) >= 2 and "LayerNorm" in name or "layer_norm" in " ".join(nodes)
               for name, nodes in shared.items()), shared
    assert compiled.check(hf_exports.sample_inputs("bert")).ok


def test_index_bounds_come_from_the_embedding_tables(hf_export):
    compiled = tvmdm.compile(hf_export("bert", dynamo=True, dynamic=True, opset=18))
    assert compiled.index_bounds["input_ids"][0] == hf_exports.VOCAB
    feeds = hf_exports.sample_inputs("bert")
    feeds["input_ids"][0, 0] = hf_exports.VOCAB
    with pytest.raises(tvmdm.InputError, match=rf"input 'input_ids' holds index {hf_exports.VOCAB}, outside \[0, "):
        compiled.run(feeds)
    np.testing.assert_equal(compiled.index_bounds["token_type_ids"][0], 2)
