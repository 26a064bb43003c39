"""Whole BERT (issue #20): the embedded bert-base, and its 12-layer tiny twin exported by both torch exporters with
dynamic axes, compiled as one symbolic module and at bound shapes, trained, and measured by tvmdm.bench.hf."""
import json

import numpy as np
import pytest

import tvmdm
from tvmdm.bench import hf as bench_hf
from tvmdm.build import options as build_options
from tvmdm import models
from tvmdm.models import hf_export as hf_exports

pytestmark = pytest.mark.slow  # end to end, a minute or more in all (`pytest -m 'not slow'` skips it)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EXPORTERS = [pytest.param(False, 17, id="legacy"), pytest.param(True, 18, id="dynamo")]


def test_embedded_bert_base_is_bert_base_uncased_sized():
    proto = tvmdm.default_model("bert-base")
    ours = sum(int(np.prod(t.dims)) for t in proto.graph.initializer if t.data_type == 1 and len(t.dims) > 0)
    hf = transformers.BertModel(transformers.BertConfig(), add_pooling_layer=False)
    assert ours == sum(p.numel() for p in hf.parameters())  # 108.9M without the pooler (110M with it)
    assert sum(1 for n in proto.graph.node if n.op_type == "LayerNormalization") == 1 + 2 * 12
    assert [i.name for i in proto.graph.input] == ["input_ids", "attention_mask", "token_type_ids"]
    assert models.default_dims("bert-base") == {"batch": 8, "seq": 128}
    assert models.is_whole_model("bert-base") and not models.is_whole_model("bert-base-layer")


@pytest.mark.parametrize("dynamo,opset", EXPORTERS)
def test_twelve_layer_twin_one_symbolic_module_serves_every_size(hf_export, dynamo, opset):
    path = hf_export("bert", dynamo=dynamo, dynamic=True, opset=opset, size="tiny-12")
    compiled = tvmdm.compile(path)
    assert all(isinstance(d, str) for spec in compiled.inputs for d in spec.shape), compiled.inputs
    for batch, seq, seed in ((1, 16, 0), (2, 8, 1), (3, 37, 2)):
        result = compiled.check(hf_exports.sample_inputs("bert", batch=batch, seq=seq, seed=seed))
        assert result.ok, f"({batch}, {seq}): {result}"
    bound = tvmdm.compile(path, shapes=bench_hf.bound_shapes(path, 2, 8))
    assert [s.shape for s in bound.inputs] == [(2, 8)] * 3
    assert bound.check(hf_exports.sample_inputs("bert")).ok


def test_symbolic_module_takes_the_packed_and_hand_written_kernels():
    # BERT-base's dims: every contraction packs (768 and 3072 are whole panels). Without shapes, the records
    # (static) cannot apply, so every kernel that matters must be one of ours, whatever this CPU is.
    compiled = tvmdm.compile(tvmdm.default_model("bert-base-layer"))
    assert any(isinstance(d, str) for spec in compiled.inputs for d in spec.shape)
    hand = set(compiled.hand_kernels)
    contractions = [k for k, ops in compiled.kernel_ops.items() if any("matmul" in op or "gemm" in op for op in ops)
                    or "gemm" in k]
    assert contractions and set(contractions) <= hand, (contractions, compiled.hand_kernels)
    assert {"sm", "attention_context", "bdrln"} <= hand, compiled.hand_kernels
    assert not compiled.tuned_kernels
    # A ragged size: whole tiles of 8 rows inside the contractions, row tiles of 1 in the row-wise kernels
    feeds = tvmdm.random_inputs(compiled, batch=3, seq=37)
    result = compiled.check(feeds)
    assert result.ok, str(result)


def test_symbolic_modules_pack_even_where_logs_were_tuned_on_this_cpu():
    from tests.helpers.cpu_kinds import BY_NAME

    zen4 = BY_NAME["zen4"].target()
    logs = build_options.resolve_logs("shipped", zen4)
    assert build_options.packed_lanes(logs, zen4, "fp32") is None  # bound shapes: the Zen 4 records serve
    assert build_options.packed_lanes(logs, zen4, "fp32", symbolic=True) == 48
    assert build_options.packed_lanes(None, zen4, "fp32", symbolic=True) is None  # tuning_logs=None: plain defaults


# the dynamo export only: the legacy one trains as PyTorch does in tests/train (2 layers, every gradient), and
# the suite must stay under ~20 minutes
@pytest.mark.parametrize("exporter", ["dynamo"])
def test_twelve_layer_classifier_trains_as_pytorch_does(tmp_path, exporter):
    # The dynamo export carries Dropout nodes (eval mode): stripped before Gradient, which has none for them.
    paths = bench_hf.export_models("tiny-12", str(tmp_path), out=lambda line: None)
    found = bench_hf.train_step(paths["bert-seqcls"][exporter], "tiny-12", 2, 8, min_runs=1, max_seconds=1.0,
                                isolated=False, out=lambda line: None)
    assert found["max_rel_loss_gap"] < 1e-5, found["losses"]
    assert found["losses"]["tvmdm"][2] < found["losses"]["tvmdm"][0]  # AdamW moved the weights


def test_bench_hf_records_compile_memory_and_data_movement(tmp_path):
    lines = []
    # one size for the memory step (each size is two fresh processes); the exports this needs and no others
    result = bench_hf.run("tiny-12", str(tmp_path), steps=("compile", "memory", "analyze"), out=lines.append,
                          sizes=[(1, 16)])
    assert not list(tmp_path.glob("bert-seqcls-*.onnx"))
    written = json.loads((tmp_path / "bench_hf-tiny-12.json").read_text())
    assert written["compile"] == result["compile"]
    assert {(r["exporter"], r["shapes"]) for r in written["compile"]} == \
        {(e, s) for e in ("legacy", "dynamo") for s in ("symbolic", "bound")}
    assert all(r["seconds"] > 0 and r["peak_rss_mb"] > 50 for r in written["compile"])
    for found in written["memory"].values():
        assert found["tvmdm"] > 0 and found["onnxruntime"] > 0
    stock, paper = written["analyze"]["compare"]
    assert paper["kernel_calls"] < stock["kernel_calls"] and paper["bytes"] < stock["bytes"]
    assert any(line.startswith("== analyze") for line in lines)
