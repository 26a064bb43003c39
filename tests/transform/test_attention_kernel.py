"""SM and the context contraction as one kernel for CPU inference (tvmdm.transform.attention_kernel; its
schedule: schedules.attention)."""
import numpy as np
import onnxruntime as ort
import pytest
import tvm
from tvm import relax, te
from tvm.s_tir import Schedule

import tvmdm
from tests.helpers.cpu_kinds import KINDS
from tvmdm.bench.quantized import quantize_dynamic
from tvmdm.build.compiled import _import
from tvmdm.build.options import make_options
from tvmdm.models.bert import BertConfig, build_encoder_layer
from tvmdm.transform.attention_kernel import ATTENTION_KERNEL, attention_kernel
from tvmdm.transform.fuse import fuse
from tvmdm.transform.kernels import private_func

HIDDEN, HEADS = 64, 2


@pytest.fixture(scope="module")
def layer():
    return build_encoder_layer(BertConfig(hidden=HIDDEN, heads=HEADS, ffn=2 * HIDDEN))


def _sm_and_context(batch=2, heads=2, seq=16, dim=8):
    """(sm, attention_context) PrimFuncs of the paper level's forms: softmax(Q K^T) [B, h, S, S], then P V ->
    [B, S, h, d]."""
    q, k = (te.placeholder((batch, seq, heads, dim), "float32", name=n) for n in "qk")
    d = te.reduce_axis((0, dim), name="d")
    scores = te.compute((batch, heads, seq, seq), lambda b, h, i, j: te.sum(q[b, i, h, d] * k[b, j, h, d], axis=d),
                        name="T_einsum")
    probs = tvm.topi.nn.softmax(scores, axis=-1)
    p = te.placeholder((batch, heads, seq, seq), "float32", name="p")
    v = te.placeholder((batch, seq, heads, dim), "float32", name="v")
    j = te.reduce_axis((0, seq), name="j")
    context = te.compute((batch, seq, heads, dim), lambda b, i, h, c: te.sum(p[b, h, i, j] * v[b, j, h, c], axis=j),
                         name="T_einsum")
    return (private_func(te.create_prim_func([q, k, probs])), private_func(te.create_prim_func([p, v, context])))


def _module(probabilities_returned: bool, batch=2, heads=2, seq=16, dim=8):
    sm, context = _sm_and_context(batch, heads, seq, dim)
    bb = relax.BlockBuilder()
    x = [relax.Var(n, relax.TensorType((batch, seq, heads, dim), "float32")) for n in "qkv"]
    with bb.function("main", x):
        with bb.dataflow():
            sm_gv, ctx_gv = bb.add_func(sm, "sm"), bb.add_func(context, "attention_context")
            probs = bb.emit(relax.call_tir(sm_gv, x[:2], relax.TensorType((batch, heads, seq, seq), "float32")))
            out = bb.emit(relax.call_tir(ctx_gv, [probs, x[2]], relax.TensorType(x[0].ty.shape, "float32")))
            result = bb.emit_output(relax.Tuple([out, probs]) if probabilities_returned else out)
        bb.emit_func_output(result)
    return bb.get()


def _run(mod, args):
    vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    return out.numpy() if hasattr(out, "numpy") else out[0].numpy()


def test_an_sm_only_the_context_reads_becomes_one_kernel_with_the_same_numbers():
    mod = _module(probabilities_returned=False)
    provenance = {"sm": ["einsum", "softmax"], "attention_context": ["einsum"]}
    merged = attention_kernel(provenance)(mod)
    prims = sorted(gv.name_hint for gv, f in merged.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    assert prims == [ATTENTION_KERNEL], prims
    assert provenance[ATTENTION_KERNEL] == ["einsum", "softmax", "einsum"]
    args = [np.random.default_rng(i).standard_normal((2, 16, 2, 8)).astype(np.float32) for i in range(3)]
    np.testing.assert_array_equal(_run(merged, args), _run(mod, args))


def test_an_sm_whose_probabilities_are_read_elsewhere_is_left_alone():
    """A training step's backward pass reads P too: it must be written to memory."""
    mod = _module(probabilities_returned=True)
    tvm.ir.assert_structural_equal(attention_kernel()(mod), mod)


def _fused_kernels(model, shapes, target="llvm"):
    mod, record = fuse(_import(model, shapes, None).mod, make_options(target, symbolic=shapes is None))
    return {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}, record


@pytest.mark.parametrize("shapes", [{"hidden_states": [2, 32, HIDDEN], "attention_mask": [2, 32]}, None],
                         ids=["static", "symbolic"])
def test_static_inference_runs_the_attention_as_one_kernel(layer, shapes):
    kernels, record = _fused_kernels(layer, shapes)
    if shapes is None:  # symbolic lengths keep SM and the context (see the pass's module doc)
        assert {"sm", "attention_context"} <= kernels and ATTENTION_KERNEL not in kernels, sorted(kernels)
        return
    assert ATTENTION_KERNEL in kernels and not {"sm", "attention_context"} & kernels, sorted(kernels)
    assert "fast_softmax" in record.kernel_ops[ATTENTION_KERNEL] and \
        record.kernel_ops[ATTENTION_KERNEL].count("einsum") == 2, record.kernel_ops[ATTENTION_KERNEL]


def _onnxruntime(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("batch, seq", [(2, 32), (3, 13)], ids=["whole-tiles", "ragged"])
def test_layer_with_the_attention_kernel_matches_onnxruntime(layer, precision, batch, seq):
    model = quantize_dynamic(layer) if precision == "int8" else layer
    shapes = {"hidden_states": [batch, seq, HIDDEN], "attention_mask": [batch, seq]}
    compiled = tvmdm.compile(model, shapes=shapes, tuning_logs=None)
    assert ATTENTION_KERNEL in compiled.kernels and ATTENTION_KERNEL in compiled.hand_kernels, compiled.kernels
    rng = np.random.default_rng(seq)
    feeds = {"hidden_states": rng.standard_normal((batch, seq, HIDDEN)).astype(np.float32),
             "attention_mask": np.ones((batch, seq), np.int64)}
    feeds["attention_mask"][0, seq - 3:] = 0  # masked keys in one sequence
    expected = _onnxruntime(model, feeds)
    tolerance = 2e-3 if precision == "int8" else 1e-5
    np.testing.assert_allclose(compiled.run(feeds)[0], expected, rtol=tolerance,
                               atol=tolerance * np.abs(expected).max())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_each_kind_computes_a_tiles_probabilities_and_context_under_one_parallel_loop(layer, kind, precision):
    model = quantize_dynamic(layer) if precision == "int8" else layer
    compiled = tvmdm.compile(model, shapes={"hidden_states": [2, 32, HIDDEN], "attention_mask": [2, 32]},
                             target=kind.target(), precision="fp32" if precision == "int8" else precision,
                             tuning_logs=None)
    if precision == "bf16" and kind.amx:  # the tile units' attention (transform.tile_attention) or batched matmuls
        assert ATTENTION_KERNEL not in compiled.kernels, compiled.kernels
        return
    assert ATTENTION_KERNEL in compiled.hand_kernels, compiled.kernels
    func = compiled.mod[ATTENTION_KERNEL]
    assert func.script().count("T.parallel") == 1
    # a register tile of rows' probabilities, then their context rows, under one (task, row tile) nest
    sch = Schedule(func)
    probs, context = (sch.get_loops(sch.get_sblock(name)) for name in ("T_softmax_norm", "T_einsum1_update"))
    assert all(sch.get(a).same_as(sch.get(b)) for a, b in zip(probs[:2], context[:2]))
    assert sch.get(probs[0]).kind == tvm.tirx.ForKind.PARALLEL
    # the key tile (key-last) and V's rows of the head, copied once a task
    copies = [b for b in sch.get_child_blocks(sch.get_loops(sch.get_sblock("T_einsum1_update"))[0])
              if sch.get(b).name_hint.endswith("_global")]
    assert len(copies) == 2, [sch.get(b).name_hint for b in copies]
