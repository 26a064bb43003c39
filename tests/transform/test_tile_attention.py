"""tvmdm.transform.tile_attention: each SM / context pair of a symbolic bf16 module, for a CPU with AMX-BF16,
becomes the operands' conversions and one tile_attention kernel (its numerics: tests/schedules/
test_amx_attention.py and the symbolic module against onnxruntime in test_amx.py)."""
import math

import pytest
import tvm

from tests.helpers.cpu_kinds import BY_NAME
from tvmdm.build.options import make_options
from tvmdm.models import BertConfig, build_encoder_layer
from tvmdm.transform.attention_padding import SM, composite_name
from tvmdm.transform.fuse import FusionRecord, TrainingFusion, graph_passes
from tvmdm.transform.ir import bindings_of, call_op
from tvmdm.transform.tile_attention import TILE_ATTENTION_ATTR, attention_func


def _graph(heads: int, kind: str = "sapphirerapids", seq: int | None = None):
    """The layer's graph after the graph passes (symbolic, or bound to (2, seq))."""
    from tvmdm.build.compiled import _import

    layer = BertConfig(hidden=96, heads=heads, ffn=192, batch=2, seq=32)
    shapes = None if seq is None else {"hidden_states": [2, seq, 96], "attention_mask": [2, seq]}
    imported = _import(build_encoder_layer(layer), shapes, None)
    options = make_options(BY_NAME[kind].target(), precision="bf16", symbolic=seq is None, tuning_logs=None)
    passes = graph_passes(options, FusionRecord(), TrainingFusion())
    return tvm.transform.Sequential(passes)(imported.mod)


def _calls(mod):
    calls = []
    for value in bindings_of(mod["main"]).values():
        if call_op(value) == "relax.call_tir":
            calls.append(value.args[0].name_hint)
        elif composite_name(mod, value):
            calls.append(composite_name(mod, value))
    return calls


def test_the_pair_becomes_operands_and_one_tile_kernel():
    mod = _graph(heads=3)
    calls = _calls(mod)
    assert SM not in calls and "tvmdm.attention_context" not in calls and "pad_keys" not in calls
    kernel = [name for name in calls if name.startswith("tile_attention")]
    assert sorted(kernel) == ["tile_attention", "tile_attention_k", "tile_attention_mask", "tile_attention_q",
                              "tile_attention_v"]
    heads, dim, scale, per_query = mod["tile_attention"].attrs[TILE_ATTENTION_ATTR]
    assert (int(heads), int(dim), int(per_query)) == (3, 32, 0) and float(scale) == pytest.approx(1 / math.sqrt(32))
    call = next(v for v in bindings_of(mod["main"]).values()
                if call_op(v) == "relax.call_tir" and v.args[0].name_hint == "tile_attention")
    assert len(call.args[1].fields) == 5  # q, k, v, mask and the number of key blocks
    assert "cut_keys" in calls  # the padded rows cut off


def test_pass_leaves_heads_off_the_tiles_to_the_padding():
    calls = _calls(_graph(heads=4))  # heads of 24
    assert SM in calls and "pad_keys" in calls and "tile_attention" not in calls


@pytest.mark.parametrize("seq, cut", [(45, True), (64, False)])
def test_static_sequences_take_it_too_cut_back_only_where_padded(seq, cut):
    calls = _calls(_graph(heads=3, seq=seq))
    assert "tile_attention" in calls and SM not in calls
    assert ("cut_keys" in calls) == cut


def test_a_cpu_without_tiles_keeps_the_papers_kernels():
    calls = _calls(_graph(heads=3, kind="zen4"))
    assert SM in calls and not [c for c in calls if c.startswith("tile_attention")]


def test_reference_kernel_is_opaque_and_says_its_shape():
    func = attention_func(2, 64, 0.125)
    assert int(func.attrs["op_pattern"]) == 8
    assert [p.name for p in func.params][4] == "blocks"
