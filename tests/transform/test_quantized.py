"""int8 contractions of quantized models (tvmdm.transform.quantized, schedules.int8) and the whole-tensor max /
min rewrite (tvmdm.transform.row_reductions), against onnxruntime on the same files."""
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import tvm
from tvm import relax

import tvmdm
from tests.helpers.cpu_kinds import BY_NAME, asm_of
from tests.helpers.quantized import int8_matmul_model, int8_matmul_reference, quantized_export
from tvmdm.core.target import has_int8_dot, make_target
from tvmdm.models import hf_export as hf_exports
from tvmdm.transform.row_reductions import rows_then_whole


def _int8_kernels(compiled) -> list[str]:
    return [k for k in compiled.hand_kernels if "int8_gemm" in k]


def _onnxruntime(model, feeds):
    return ort.InferenceSession(model.SerializeToString() if not isinstance(model, str) else model,
                                providers=["CPUExecutionProvider"]).run(None, feeds)


def _compile(model, **kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no VNNI")  # asserted in tests/build/test_cpu_kinds.py
        return tvmdm.compile(model, **kwargs)


def _target_without_vnni() -> tvm.target.Target:
    """This CPU where it has no AVX512-VNNI, else the AVX2 kind where its code runs here."""
    host = make_target("llvm")
    if not has_int8_dot(host):
        return host
    reason = BY_NAME["zen4-avx2"].cannot_run_here()
    if reason:
        pytest.skip(reason)
    return BY_NAME["zen4-avx2"].target()


@pytest.mark.parametrize("weights, instruction", [("normal", "vpmaddubsw"), ("full range", "vpmaddwd")])
def test_without_vnni_contractions_are_exact_where_onnxruntimes_avx2_kernel_saturates(weights, instruction):
    # quantize_dynamic's weights of normal ones (the largest at 127) pair within int16 once K is reordered:
    # vpmaddubsw, the activations reordered by their quantization; uniform ones do not: exact int16 pairs
    rng = np.random.default_rng(0)
    normal = rng.standard_normal((256, 64))
    weight = (np.round(normal / np.abs(normal).max() * 127) if weights == "normal" else
              rng.integers(-127, 128, (256, 64))).astype(np.int8)
    model = int8_matmul_model(256, 64, weight=weight)
    compiled = _compile(model, shapes={"x": [2, 24, 256]}, target=_target_without_vnni(), tuning_logs=None)
    asm = asm_of(compiled)
    assert instruction in asm and ("vpmaddubsw" in asm) == (weights == "normal")
    assert any("reorder_k" in k for k in compiled.kernels) == (weights == "normal")
    # a column whose pairs in their stored order reach past int16 (vpmaddubsw on that order saturates; so does
    # onnxruntime on an AVX2 CPU, on this row), and a row that pushes every product of it to its extreme, 255 * w
    pair_sums = np.abs(weight[0::2].astype(np.int32) + weight[1::2])
    column = int(np.flatnonzero((pair_sums > 128).any(axis=0))[0])
    x = np.random.default_rng(1).standard_normal((2, 24, 256)).astype(np.float32) * 3
    x[0, 0] = np.where(weight[:, column] > 0, 1e3, -1e3)
    np.testing.assert_allclose(compiled.run({"x": x})[0], int8_matmul_reference(model, x), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("k, n, w_zero_point, rewritten", [
    (64, 48, 0, "vnni avx2"),
    (64, 40, 0, "avx2"),  # N not whole 16-column panels (8 on AVX2): the frontend's generic int32 matmul
    (62, 48, 0, "avx2"),  # K not whole quads (AVX2: exact int16 pairs)
    (64, 48, 3, ""),  # a weight zero point (quantize_dynamic's int8 weights have none)
])
def test_matmul_integer_matches_onnxruntime_and_takes_the_int8_kernel_where_it_fits(k, n, w_zero_point, rewritten):
    model = int8_matmul_model(k, n, w_zero_point)
    x = np.random.default_rng(1).standard_normal((2, 12, k)).astype(np.float32)
    compiled = _compile(model, shapes={"x": [2, 12, k]}, tuning_logs=None)
    assert bool(_int8_kernels(compiled)) == (("vnni" if has_int8_dot(make_target("llvm")) else "avx2") in rewritten)
    (expected,) = _onnxruntime(model, {"x": x})
    # the same integers and the same scale: only the fp32 epilogue's rounding differs
    np.testing.assert_allclose(compiled.run({"x": x})[0], expected, rtol=1e-5, atol=1e-5)


def test_symbolic_rows_take_whole_tiles_and_match_at_every_length():
    model = int8_matmul_model(64, 32)
    compiled = _compile(model, tuning_logs=None)  # batch and seq symbolic
    assert _int8_kernels(compiled)
    for batch, seq in [(1, 1), (3, 13), (2, 64)]:
        x = np.random.default_rng(seq).standard_normal((batch, seq, 64)).astype(np.float32)
        (expected,) = _onnxruntime(model, {"x": x})
        np.testing.assert_allclose(compiled.run({"x": x})[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
@pytest.mark.parametrize("symbolic", [False, True], ids=["bound", "symbolic"])
def test_quantize_dynamic_bert_export_matches_onnxruntime(hf_export, tmp_path, symbolic, dynamo):
    path = quantized_export(hf_export, tmp_path, dynamo=dynamo)
    feeds = hf_exports.sample_inputs("bert", batch=2, seq=8)
    shapes = None if symbolic else {name: list(v.shape) for name, v in feeds.items()}
    compiled = _compile(path, shapes=shapes)
    matmul_integers = sum(node.op_type == "MatMulInteger" for node in __import__("onnx").load(path).graph.node)
    assert len(_int8_kernels(compiled)) == matmul_integers == 13  # 6 per layer and the pooler: every one
    expected = _onnxruntime(path, feeds)
    for got, want in zip(compiled.run(feeds), expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def _max_min_module(shape, ops=(relax.op.max, relax.op.min)):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            reduced = [bb.emit(op(x)) for op in ops]
            out = bb.emit_output(relax.op.subtract(*reduced) if len(reduced) == 2 else reduced[0])
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, x):
    vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def test_whole_tensor_max_and_min_reduce_rows_first_in_one_kernel_with_the_same_results():
    # DynamicQuantizeLinear's max and min of one tensor: one kernel reduces each row to both ([max, -min]),
    # then one max over the rows gives the two
    mod = _max_min_module((4, 6, 32))
    rewritten = rows_then_whole()(mod)
    script = rewritten["main"].script()
    assert script.count("R.call_tir(row_extrema") == 1 and script.count("R.max(") == 1 and "R.min(" not in script
    x = np.random.default_rng(0).standard_normal((4, 6, 32)).astype(np.float32)
    assert _run(mod, x) == _run(rewritten, x) == x.max() - x.min()
    x[1, 2, 3], x[3, 0, 0] = 7.5, -9.25  # the extremes in other rows
    assert _run(rewritten, x) == 16.75
    # a max alone: its rows, then the whole
    alone = rows_then_whole()(_max_min_module((4, 6, 32), ops=(relax.op.max,)))
    assert alone["main"].script().count("axis=[-1]") == 1 and _run(alone, x) == x.max()
    assert rows_then_whole()(_max_min_module((32,)))["main"].script().count("axis=[-1]") == 0  # rank 1: as it is


@pytest.mark.parametrize("activation, per_column", [("uint8", False), ("int8", False), ("int8", True)])
def test_qdq_files_take_the_same_kernel_and_match_onnxruntime(activation, per_column):
    from tests.helpers.quantized import qdq_matmul_model

    model = qdq_matmul_model(64, 48, activation, per_column)
    compiled = _compile(model, tuning_logs=None)
    assert _int8_kernels(compiled)
    for batch, seq in [(2, 12), (1, 5)]:
        x = np.random.default_rng(seq).standard_normal((batch, seq, 64)).astype(np.float32)
        (expected,) = _onnxruntime(model, {"x": x})
        # onnxruntime multiplies the dequantized floats; the kernel scales the exact integer sum once
        np.testing.assert_allclose(compiled.run({"x": x})[0], expected, rtol=1e-4, atol=1e-4)


def test_analyze_counts_the_int8_contraction_and_the_bytes_it_moves():
    report = tvmdm.analyze(int8_matmul_model(64, 48), shapes={"x": [2, 12, 64]})
    row = next(r for r in report.rows if "int8_gemm" in r.kernel)
    assert row.op_class == "tensor contraction" and row.flops >= 2 * 24 * 64 * 48
    # 1 byte per activation and weight: x (24 x 64) and W (64 x 48); 4 per column sum and bias value; the zero
    # point (1) and the activation scale (4; the weight's is a constant folded into the kernel)
    assert row.bytes_read == 24 * 64 + 64 * 48 + 4 * 48 * 2 + 1 + 4
    assert row.bytes_written == 24 * 48 * 4
