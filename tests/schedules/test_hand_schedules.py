"""The CPU kernels scheduled by hand before the logs apply (schedules.reductions, schedules.transposes): bias
and LayerNorm-parameter gradients, 2-D transposes; same numbers as numpy, left out of tuning. And after them,
the paper's SM kernel where no record covers it (schedules.attention), and row-wise normalizations
(schedules.rows)."""
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

import tvmdm

from schedules.pipeline import apply_schedules, scheduled_by
from schedules.reductions import ColumnReductions, is_column_reduction
from schedules.rows import RowNormalizations as RowRule
from schedules.transposes import Transposes as TransposeRule, is_transpose
from tvmdm.core.options import Options


def _with_rule(mod, rule, target=None):
    """``mod`` through the schedule pass with ``rule`` alone; the kernels it took."""
    scheduled = apply_schedules(Options(target or tvm.target.Target({"kind": "llvm"})), [rule])(mod)
    return scheduled, scheduled_by(scheduled, rule)
from tvmdm.transform.fuse import lowering_passes


def _lowered(mod):
    return tvm.transform.Sequential(lowering_passes() + [relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)


@tvm.script.ir_module
class BiasAndScaleGradients:
    @R.function
    def main(dy: R.Tensor((4, 8, 96), "float32"), xhat: R.Tensor((4, 8, 96), "float32")):
        with R.dataflow():
            db = R.collapse_sum_to(dy, R.shape([96]))
            both = R.sum(R.concat([R.multiply(dy, xhat), dy], axis=2), axis=[0, 1])  # BSB's form
            rows = R.sum(dy, axis=[2])  # a row reduction: not this rule's
            out = (db, both, rows)
            R.output(out)
        return out


def test_column_reductions_are_scheduled_and_exact():
    mod = _lowered(BiasAndScaleGradients)
    kinds = {gv.name_hint: is_column_reduction(f) for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    scheduled, done = _with_rule(mod, ColumnReductions())
    assert sorted(done) == sorted(name for name, col in kinds.items() if col)
    assert len(done) >= 2 and not all(kinds.values())  # the row sum is left to the default schedule
    from schedules.default import apply_default_schedules

    target = tvm.target.Target({"kind": "llvm"})
    vm = relax.VirtualMachine(relax.build(apply_default_schedules(scheduled, target), target=target), tvm.cpu())
    rng = np.random.default_rng(0)
    dy, xhat = (rng.standard_normal((4, 8, 96)).astype(np.float32) for _ in range(2))
    db, both, rows = (t.numpy() for t in vm["main"](tvm.runtime.tensor(dy), tvm.runtime.tensor(xhat)))
    np.testing.assert_allclose(db, dy.sum((0, 1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(both, np.concatenate([dy * xhat, dy], 2).sum((0, 1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rows, dy.sum(2), rtol=1e-5, atol=1e-5)


@tvm.script.ir_module
class Transposes:
    @R.function
    def main(w: R.Tensor((48, 96), "float32"), x: R.Tensor((2, 48, 96), "float32")):
        with R.dataflow():
            wt = R.permute_dims(w, [1, 0])
            xt = R.permute_dims(x, [0, 2, 1])  # batched: not this rule's
            out = (wt, xt)
            R.output(out)
        return out


def test_two_d_transposes_are_tiled_and_exact():
    from schedules.default import apply_default_schedules

    mod = _lowered(Transposes)
    scheduled, done = _with_rule(mod, TransposeRule())
    assert len(done) == 1 and is_transpose(mod[done[0]])
    target = tvm.target.Target({"kind": "llvm"})
    vm = relax.VirtualMachine(relax.build(apply_default_schedules(scheduled, target), target=target), tvm.cpu())
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((48, 96)).astype(np.float32), rng.standard_normal((2, 48, 96)).astype(np.float32)
    wt, xt = (t.numpy() for t in vm["main"](tvm.runtime.tensor(w), tvm.runtime.tensor(x)))
    np.testing.assert_array_equal(wt, w.T)
    np.testing.assert_array_equal(xt, x.transpose(0, 2, 1))


def test_tuner_leaves_hand_scheduled_kernels_out(tiny_layer):
    from tvmdm.tune.tuner import extract_tasks

    tasks, _ = extract_tasks(tiny_layer, "llvm", {"hidden_states": [2, 8, 32], "attention_mask": [2, 8]}, train=True)
    names = [t.task_name for t in tasks]
    assert names and not [n for n in names if "collapse_sum" in n]
    assert not [t for t in tasks if is_column_reduction(t.dispatched[0]["main"]) or is_transpose(t.dispatched[0]["main"])]
    # the paper's attention kernels and row normalizations too (their schedules beat the records)
    assert not {"sm", "attention_context", "bdrln"} & set(names) and [n for n in names if "matmul" in n]


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_sm_without_a_record_is_scheduled_per_head_and_matches_onnxruntime(tiny_layer, layout):
    # schedules.attention: one parallel loop, a task per (batch, head) = 2 x 2 here, around all of SM's blocks
    # (the default rule parallelizes each block apart), K read from a key-last tile; Q and K in place from the
    # packed QKV (bshd) or from head-major copies (bhsd).
    compiled = tvmdm.compile(tiny_layer, shapes={"hidden_states": [2, 8, 32], "attention_mask": [2, 8]},
                             fusion="paper", layout=layout, tuning_logs=None)
    # Static inference: SM with the context contraction in one kernel (tvmdm.transform.attention_kernel), each
    # tile of query rows' context right after its probabilities, V's rows of the head copied too.
    script = compiled.mod["attention"].script()
    parallel = [line for line in script.splitlines() if "T.parallel" in line]
    assert len(parallel) == 1 and "T.parallel(T.int64(4))" in parallel[0] and script.count('_global")') == 2, parallel
    assert compiled.check(tvmdm.random_inputs(compiled, batch=2, seq=8)).ok
    # A symbolic module keeps the two: P V's accumulators per (batch, head) task, V in place
    symbolic = tvmdm.compile(tiny_layer, fusion="paper", layout=layout, tuning_logs=None)
    context = symbolic.mod["attention_context"].script()
    assert "_global" not in context and '"local"' in context and "T.parallel(batch * T.int64(2))" in context
    assert "T.parallel(batch * T.int64(2))" in symbolic.mod["sm"].script()
    assert symbolic.check(tvmdm.random_inputs(symbolic, batch=2, seq=8)).ok


def test_context_kernel_keeps_its_accumulators_in_avx512_registers():
    # P V on AVX-512 (built for the Zen 4 kind on any machine): 8 rows x 2 vectors of accumulators and the V
    # vectors fit the 32 zmm registers (8 x 4 took all 32 for accumulators: 14 spills to the stack, 1.4x slower)
    from tests.helpers.cpu_kinds import BY_NAME, asm_of, function_asm, stack_spills
    from tvmdm.models import BertConfig, build_encoder_layer

    # (a symbolic module: static ones merge it with SM, tvmdm.transform.attention_kernel)
    compiled = tvmdm.compile(build_encoder_layer(BertConfig(hidden=128, heads=2, ffn=256, batch=2, seq=64)),
                             fusion="paper", target=BY_NAME["zen4"].target(), tuning_logs=[])
    context = function_asm(asm_of(compiled), "attention_context_compute_")
    assert sum("vfmadd" in line and "zmm" in line for line in context) >= 16, context  # the micro-kernel is here
    assert not stack_spills(context), stack_spills(context)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_attention_micro_kernels_on_whole_vectors_match_onnxruntime(layout):
    # 64 keys and head dim 64: whole register tiles in both kernels (the tiny layer's 8 keys take the ragged
    # path), the key tile copied in 8 x 8 squares; the packed contractions around them as a CPU without a
    # record of its own gets them.
    from tvmdm.models import BertConfig, build_encoder_layer

    shapes = {"hidden_states": [2, 64, 128], "attention_mask": [2, 64]}
    compiled = tvmdm.compile(build_encoder_layer(BertConfig(hidden=128, heads=2, ffn=256, batch=2, seq=64)),
                             shapes=shapes, fusion="paper", layout=layout, tuning_logs=[])
    script = compiled.mod["attention"].script()  # SM and the context, one kernel (static inference)
    assert script.count('"local"') == 2 and "T.unroll" in script
    feeds = tvmdm.random_inputs(compiled, batch=2, seq=64)
    feeds["attention_mask"][1, 40:] = 0  # padded keys: the mask reaches the softmax inside SM
    result = compiled.check(feeds)
    assert result.ok, str(result)


def test_scores_form_with_query_rows_in_the_middle_is_tasked_per_batch_and_head():
    # dQ = dS K written [B, S, h, d] from K^T [B, h, d, S] (a dynamo export's backward pass): the tasks must be
    # the axes K^T has (B, h), each copying its key tile once; tasked per (B, S) it copied the tile per query row
    # (12.2 ms for BERT-base's shape on a Sapphire Rapids VM, 0.66 ms per (B, h)).
    from tvm import te

    from schedules.attention import schedule_scores

    b, h, s, d = 2, 3, 16, 32
    ds = te.placeholder((b, h, s, s), "float32", name="ds")
    kt = te.placeholder((b, h, d, s), "float32", name="kt")
    j = te.reduce_axis((0, s), name="j")
    out = te.compute((b, s, h, d), lambda n, i, m, c: te.sum(ds[n, m, i, j] * kt[n, m, c, j], axis=j), name="T_einsum")
    scheduled = schedule_scores(te.create_prim_func([ds, kt, out]), 16)
    parallel = [line for line in scheduled.script().splitlines() if "T.parallel" in line]
    assert len(parallel) == 1 and "n_m_fused" in parallel[0] and f"({b * h})" in parallel[0], parallel
    lib = tvm.compile(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), target="llvm")
    rng = np.random.default_rng(0)
    a, k = rng.standard_normal((b, h, s, s)).astype("float32"), rng.standard_normal((b, h, d, s)).astype("float32")
    got = tvm.runtime.tensor(np.zeros((b, s, h, d), "float32"))
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(k), got)
    np.testing.assert_allclose(got.numpy(), np.einsum("nmij,nmcj->nimc", a, k), rtol=1e-5, atol=1e-5)



def test_sm_reading_a_key_last_operand_is_scheduled_by_hand():
    # torch's dynamo export hands SM K^T [B, h, d, S], already key-last: that SM was left to the default rule
    # (BERT-base's 12 layers at (8, 128), 2 Sapphire Rapids cores: 761 -> 671 ms); its key tile is a plain copy
    from tvm import te, topi

    from schedules.attention import schedule_scores

    b, h, s, d = 2, 3, 32, 16
    q = te.placeholder((b, s, h, d), "float32", name="q")
    kt = te.placeholder((b, h, d, s), "float32", name="kt")
    r = te.reduce_axis((0, d), name="r")
    scores = te.compute((b, h, s, s), lambda n, m, i, j: te.sum(q[n, i, m, r] * kt[n, m, r, j], axis=r),
                        name="T_einsum")
    func = te.create_prim_func([q, kt, topi.nn.softmax(scores, axis=-1)])
    scheduled = schedule_scores(func, 16)
    assert scheduled is not None
    script = scheduled.script()
    assert script.count("T.parallel") == 1 and '"local"' in script and "kt_global" in script
    lib = tvm.compile(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), target="llvm")
    rng = np.random.default_rng(1)
    a, k = rng.standard_normal((b, s, h, d)).astype("float32"), rng.standard_normal((b, h, d, s)).astype("float32")
    got = tvm.runtime.tensor(np.zeros((b, h, s, s), "float32"))
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(k), got)
    logits = np.einsum("nimr,nmrj->nmij", a, k)
    want = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(got.numpy(), want / want.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    # alone (no softmax after it) the same form is a context-like contraction, left to the default rule
    assert schedule_scores(te.create_prim_func([q, kt, scores]), 16) is None

@tvm.script.ir_module
class RowNormalizations:
    @R.function
    def main(x: R.Tensor((4, 8, 64), "float32"), r: R.Tensor((4, 8, 64), "float32"), g: R.Tensor((64,), "float32"),
             b: R.Tensor((64,), "float32"), odd: R.Tensor((4, 8, 40), "float32")):
        with R.dataflow():
            ln = R.nn.layer_norm(R.add(R.add(x, b), r), g, b, axes=[-1], epsilon=1e-5)
            sm = R.nn.softmax(x, axis=-1)
            centred = R.subtract(x, R.mean(x, axis=[2], keepdims=True))  # a kept axis of 1
            ragged = R.nn.softmax(odd, axis=-1)  # 40 columns: not whole vectors, left to the default rule
            middle = R.sum(x, axis=[1])  # reduces a middle axis: not a row normalization
            out = (ln, sm, centred, ragged, middle)
            R.output(out)
        return out


def test_row_normalizations_are_scheduled_per_row_tile_and_exact():
    from schedules.default import apply_default_schedules

    mod = _lowered(RowNormalizations)
    scheduled, done = _with_rule(mod, RowRule(), tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))  # 16 lanes
    # not: the ragged softmax (fast_softmax1), the middle-axis sum, the element-wise adds
    assert sorted(done) == ["fast_softmax", "fused_mean_subtract", "layer_norm"]
    for name in done:
        script = scheduled[name].script()
        assert "_rf" in script and "T.parallel" in script  # lane partials, rows in parallel
    target = tvm.target.Target({"kind": "llvm"})
    vm = relax.VirtualMachine(relax.build(apply_default_schedules(scheduled, target), target=target), tvm.cpu())
    rng = np.random.default_rng(0)
    x, r = (rng.standard_normal((4, 8, 64)).astype(np.float32) for _ in range(2))
    g, b = (rng.standard_normal(64).astype(np.float32) for _ in range(2))
    odd = rng.standard_normal((4, 8, 40)).astype(np.float32)
    ln, sm, centred, ragged, middle = (t.numpy() for t in vm["main"](*map(tvm.runtime.tensor, (x, r, g, b, odd))))
    h = x + b + r
    want_ln = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5) * g + b

    def softmax(a):
        e = np.exp(a - a.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    np.testing.assert_allclose(ln, want_ln, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(sm, softmax(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(centred, x - x.mean(-1, keepdims=True), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ragged, softmax(odd), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(middle, x.sum(1), rtol=1e-5, atol=1e-5)


def test_a_lone_row_reduction_gets_row_tiles_and_a_contraction_does_not():
    from tvm import te, topi

    from schedules.rows import schedule_row_reduction

    x = te.placeholder((4, 6, 64), "float32", name="x")
    row_max = te.create_prim_func([x, topi.max(x, axis=-1)]).with_attr("global_symbol", "main")
    scheduled = schedule_row_reduction(row_max, 16)
    assert scheduled is not None and "T.parallel" in scheduled.script()
    data = np.random.default_rng(0).standard_normal((4, 6, 64)).astype("float32")
    out = tvm.runtime.tensor(np.zeros((4, 6), "float32"))
    tvm.tirx.build(scheduled, target="llvm")(tvm.runtime.tensor(data), out)
    np.testing.assert_array_equal(out.numpy(), data.max(axis=-1))
    w = te.placeholder((64, 32), "float32", name="w")
    x2 = te.placeholder((24, 64), "float32", name="x2")
    contraction = te.create_prim_func([x2, w, topi.matmul(x2, w)]).with_attr("global_symbol", "main")
    assert schedule_row_reduction(contraction, 16) is None  # two inputs: a matmul is no row reduction


def test_row_extrema_reduce_each_row_to_its_max_and_negated_min_in_one_task():
    from tvmdm.transform.row_reductions import row_extrema_func

    from schedules.rows import schedule_row_extrema

    scheduled = schedule_row_extrema(row_extrema_func([4, 6, 64], "float32").with_attr("global_symbol", "main"), 16)
    script = scheduled.script()
    # both reductions as vector-lane partials under the one parallel loop of row tiles
    assert script.count("T.parallel") == 1 and script.count("T.vectorized") >= 2
    parallel = script.index("T.parallel")
    assert parallel < script.index('T.sblock("row_max_rf")') and parallel < script.index('T.sblock("row_min_rf")')
    data = np.random.default_rng(0).standard_normal((4, 6, 64)).astype("float32")
    out = tvm.runtime.tensor(np.zeros((4, 6, 2), "float32"))
    tvm.tirx.build(scheduled, target="llvm")(tvm.runtime.tensor(data), out)
    np.testing.assert_array_equal(out.numpy(), np.stack([data.max(-1), -data.min(-1)], axis=-1))
    assert schedule_row_extrema(row_extrema_func([4, 6, 40], "float32").with_attr("global_symbol", "main"), 16) \
        is None  # rows off whole vectors: the default rule's
