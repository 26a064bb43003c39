"""DynamicQuantizeLinear's statistics computed by the kernel that produces the activation
(tvmdm.transform.stats_into_producers; their placement: schedules.rows)."""
import numpy as np
import onnxruntime as ort
import pytest
import tvm

import tvmdm
from tests.helpers.cpu_kinds import KINDS
from tvmdm.bench.quantized import quantize_dynamic
from tvmdm.build.compiled import _import
from tvmdm.build.options import make_options
from tvmdm.models.bert import BertConfig, build_encoder_layer
from tvmdm.transform.fuse import fuse
from tvmdm.transform.stats_into_producers import GROUP_ROWS, extrema_partials_func, partials_shape


HIDDEN = 64  # K a whole AMX-INT8 tile row (64 bytes): the Sapphire Rapids kind takes the tile schedule


@pytest.fixture(scope="module")
def quantized_layer():
    return quantize_dynamic(build_encoder_layer(BertConfig(hidden=HIDDEN, heads=2, ffn=2 * HIDDEN)))


def _partials(shape, group_rows, y):
    kernel = tvm.compile(extrema_partials_func(shape, group_rows).with_attr("global_symbol", "main"), target="llvm")
    out = tvm.runtime.tensor(np.zeros(partials_shape(shape, group_rows), np.float32))
    kernel(tvm.runtime.tensor(y), out)
    return out.numpy()


@pytest.mark.parametrize("rows", [64, 50], ids=["whole-groups", "last-group-short"])
def test_a_contractions_partials_are_each_columns_max_and_negated_min_over_groups_of_rows(rows):
    y = np.random.default_rng(rows).standard_normal((3, rows, 48)).astype(np.float32)
    y[2, rows - 1, 5] = 9.5  # extremes in the last (short) group
    y[1, 0, 47] = -8.25
    got = _partials(y.shape, GROUP_ROWS, y)
    groups = -(-rows // GROUP_ROWS)
    assert got.shape == (2, 3, groups, 48)
    for g in range(groups):
        block = y[:, g * GROUP_ROWS:(g + 1) * GROUP_ROWS]
        np.testing.assert_array_equal(got[0, :, g], block.max(axis=1))
        np.testing.assert_array_equal(got[1, :, g], -block.min(axis=1))
    assert got[0].max() == y.max() == 9.5 and -got[1].max() == y.min() == -8.25


def test_a_row_wise_producers_partials_are_each_rows_maxima_a_vector_wide():
    y = np.random.default_rng(1).standard_normal((2, 5, 64)).astype(np.float32)
    got = _partials(y.shape, None, y)
    assert got.shape == (2, 5, 2, 16)  # a row's two slots side by side
    np.testing.assert_array_equal(got[..., 0, :], y.reshape(2, 5, 4, 16).max(axis=2))
    np.testing.assert_array_equal(got[..., 1, :], -y.reshape(2, 5, 4, 16).min(axis=2))


def _fused(model, shapes, target="llvm"):
    imported = _import(model, shapes, None)
    return fuse(imported.mod, make_options(target, symbolic=shapes is None))


def test_layernorm_and_the_ffn_contraction_write_the_next_quantizations_statistics(quantized_layer):
    mod, record = _fused(quantized_layer, {"hidden_states": [2, 64, HIDDEN], "attention_mask": [2, 64]})
    main = mod["main"].script()
    merged = sorted(gv.name_hint for gv in mod.functions if gv.name_hint.endswith("_stats"))
    # LayerNorm (BDRLN) before FFN1, FFN1's contraction with its GELU before FFN2
    assert len(merged) == 2 and merged[0].startswith("bdrln") and "int8_gemm" in merged[1], merged
    for name in merged:
        assert record.kernel_ops[name][-1] == "row_extrema"
        assert f"R.call_tir({name}," in main
    # the layer's input and the attention's context come from no such kernel: they keep row_extrema
    assert main.count("R.call_tir(row_extrema") == 2
    assert main.count("R.call_tir(extrema_of_partials") == 2


def _onnxruntime(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("batch, seq, symbolic, merged", [(2, 64, False, 2), (3, 20, False, 1), (3, 20, True, 1)],
                         ids=["whole-groups", "ragged-rows", "symbolic"])
def test_quantized_layer_with_the_statistics_in_their_producers_matches_onnxruntime(quantized_layer, batch, seq,
                                                                                      symbolic, merged):
    # rows off whole groups (static or symbolic): the contraction keeps row_extrema, LayerNorm takes them
    shapes = None if symbolic else {"hidden_states": [batch, seq, HIDDEN], "attention_mask": [batch, seq]}
    compiled = tvmdm.compile(quantized_layer, shapes=shapes, tuning_logs=None)
    assert len([k for k in compiled.kernels if k.endswith("_stats")]) == merged, compiled.kernels
    rng = np.random.default_rng(seq)
    feeds = {"hidden_states": rng.standard_normal((batch, seq, HIDDEN)).astype(np.float32),
             "attention_mask": np.ones((batch, seq), np.int64)}
    feeds["attention_mask"][0, seq - 3:] = 0
    expected = _onnxruntime(quantized_layer, feeds)
    np.testing.assert_allclose(compiled.run(feeds)[0], expected, rtol=2e-3, atol=2e-3 * np.abs(expected).max())


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_each_kinds_producers_compute_the_partials_under_their_own_parallel_loop(quantized_layer, kind):
    compiled = tvmdm.compile(quantized_layer, shapes={"hidden_states": [2, 64, HIDDEN], "attention_mask": [2, 64]},
                             target=kind.target(), tuning_logs=None)
    merged = [k for k in compiled.kernels if k.endswith("_stats")]
    assert len(merged) == 2 and set(merged) <= set(compiled.hand_kernels), compiled.kernels
    for name in merged:  # one parallel loop: the partials of a unit's rows right after the unit wrote them
        script = compiled.mod[name].script()
        assert script.count("T.parallel") == 1 and 'T.sblock("extrema_partials_o")' in script, name
        assert ("tdpbusd" in script) == (kind.amx and "int8_gemm" in name), name
