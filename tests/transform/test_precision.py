"""precision="bf16": weight contractions on bf16 operands with fp32 accumulation (AVX512-BF16), checked against
onnxruntime fp32 within the documented tolerance, and the generated code really uses vdpbf16ps."""
import re
import warnings

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from tvmdm.models import hf_export as hf_exports
from tests.helpers.cpu_kinds import asm_of
import tvmdm
from schedules.logs import shipped_logs
from schedules.bf16 import has_bf16_dot, schedule_bf16_gemm
from tvmdm.analysis.profile import call_sites
from tvmdm.core.precision import BF16_MAX_REL_ERR
from tvmdm.transform.precision import bf16_contractions
from tvmdm.transform.kernels import gemm_func
from tvmdm.core.target import has_amx_bf16, make_target

TINY = {"hidden_states": [2, 8, 32], "attention_mask": [2, 8]}
HAS_BF16 = has_bf16_dot(make_target("llvm"))  # the CPU as tvmdm.target reads it (TVMDM_CPUINFO included)
HAS_AMX = has_amx_bf16(make_target("llvm"))
needs_bf16_cpu = pytest.mark.skipif(not HAS_BF16, reason="this CPU has no AVX512-BF16 (vdpbf16ps): its bf16 "
                                    "kernels take the generic schedule, tested in test_cpu_kinds for each kind")


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round to bf16 (nearest even) and back to fp32, as to_bf16 / pack_bf16 do."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def _max_rel_err(compiled, inputs) -> float:
    got, ref = compiled.run(inputs), compiled.reference(inputs)
    return max(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got, ref))


@pytest.mark.parametrize("fusion", ["tvm", "paper"])
def test_bf16_layer_within_tolerance_of_onnxruntime_fp32(tiny_layer, fusion):
    compiled = tvmdm.compile(tiny_layer, shapes=TINY, fusion=fusion, precision="bf16")
    assert compiled.precision == "bf16"
    # The weight contractions (merged QKV or Q, K, V; output; FFN up and down) are bf16 kernels, and under stock
    # fusion the attention's context contraction too (the scores' N = seq = 8 is no multiple of 16); the paper
    # level's attention is SM and context in fp32, except on AMX: heads of 16 are off its tile kernel (which needs
    # multiples of 32), so the attention stays batched matmuls, the context's on the dot products.
    gemms = sum(n for k, n in call_sites(compiled.mod).items() if "bf16_gemm" in k)
    assert gemms == ((5 if HAS_AMX else 4) if fusion == "paper" else 7), call_sites(compiled.mod)
    inputs = tvmdm.random_inputs(compiled, batch=2, seq=8)
    err = _max_rel_err(compiled, inputs)
    assert 0 < err <= BF16_MAX_REL_ERR  # > 0: the contractions really rounded to bf16
    fp32 = tvmdm.compile(tiny_layer, shapes=TINY, fusion=fusion)
    assert _max_rel_err(fp32, inputs) < err / 10


@needs_bf16_cpu
def test_bf16_kernels_use_the_avx512_bf16_dot_product(tiny_layer):
    compiled = tvmdm.compile(tiny_layer, shapes=TINY, precision="bf16")
    assert "vdpbf16ps" in asm_of(compiled)
    assert "vdpbf16ps" not in asm_of(tvmdm.compile(tiny_layer, shapes=TINY))


def test_the_pass_converts_each_activation_once_and_packs_weights_at_load(tiny_layer):
    from onnx_import import import_onnx

    mod = import_onnx(tiny_layer, shapes=TINY).mod
    out = tvm.transform.Sequential([bf16_contractions(), relax.transform.LiftTransformParams()])(mod)
    calls = {"matmul": 0}

    def count(expr):
        if isinstance(expr, relax.Call):
            if isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.matmul":
                calls["matmul"] += 1
            elif isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.call_tir":
                name = next(n for n in ("bf16_gemm", "to_bf16", "other") if expr.args[0].name_hint.startswith(n)
                            or n == "other")
                calls[name] = calls.get(name, 0) + 1

    relax.analysis.post_order_visit(out["main"].body, count)
    # Q, K, V, out, FFN up, FFN down and the attention's context in bf16 (its V packed per call: "other"); the
    # scores stay an fp32 matmul (N = 8); 5 activations converted (layer input, probabilities, context, first
    # LayerNorm, GELU), none twice.
    assert calls == {"matmul": 1, "bf16_gemm": 7, "to_bf16": 5, "other": 1}, calls
    packed = {"n": 0}
    relax.analysis.post_order_visit(out["main_transform_params"].body, lambda e: packed.__setitem__(
        "n", packed["n"] + (isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and
                            e.op.name == "relax.call_tir" and e.args[0].name_hint.startswith("pack_bf16"))))
    assert packed["n"] == 6


def test_transposed_weights_gemm_and_odd_rows():
    """ONNX Gemm with transB=1 reads W^T; 3 x 5 rows is not a multiple of the 4-row tile."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 32)).astype(np.float32)
    b = rng.standard_normal(48).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [15, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [15, 48])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    compiled = tvmdm.compile(model, precision="bf16")
    assert any("bf16_gemm" in k for k in compiled.kernels), compiled.kernels
    x = rng.standard_normal((15, 32)).astype(np.float32)
    got = compiled.run({"x": x})[0]
    expected = _bf16(x).astype(np.float64) @ _bf16(w).T.astype(np.float64) + b
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)  # exact products, fp32 sums


@needs_bf16_cpu
@pytest.mark.parametrize("lead,k,n,rows,vectors", [((2, 12), 64, 48, None, None), ((6,), 512, 32, 2, 2)])
def test_micro_kernel_matches_numpy(lead, k, n, rows, vectors):
    func = schedule_bf16_gemm(gemm_func(lead, k, n).with_attr("global_symbol", "main"), rows, vectors)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=make_target("llvm"))
    rng = np.random.default_rng(1)
    a = _bf16(rng.standard_normal(lead + (k,)).astype(np.float32))
    w = _bf16(rng.standard_normal((k, n)).astype(np.float32))
    bits = lambda x: (x.view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731 - exact: x is bf16 already
    packed = bits(w).reshape(k // 2, 2, n // 16, 16).transpose(2, 0, 3, 1).copy()
    out = tvm.runtime.tensor(np.zeros(lead + (n,), np.float32))
    lib["main"](tvm.runtime.tensor(bits(a)), tvm.runtime.tensor(packed), out)
    np.testing.assert_allclose(out.numpy(), a.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-4)


def test_cpu_without_bf16_dot_warns_and_computes_the_same(tiny_layer):
    host = make_target("llvm")  # this CPU with its bf16 dot product (if any) switched off: code that runs here
    target = {"kind": "llvm", "mcpu": str(host.attrs["mcpu"]), "mattr": [*host.attrs.get("mattr", []), "-avx512bf16"],
              "num-cores": 2}
    assert not has_bf16_dot(make_target(target))
    with pytest.warns(UserWarning, match="no AVX512-BF16"):
        slow = tvmdm.compile(tiny_layer, shapes=TINY, precision="bf16", target=target, tuning_logs=None)
    assert "vdpbf16ps" not in asm_of(slow)
    inputs = tvmdm.random_inputs(slow, batch=2, seq=8)
    assert _max_rel_err(slow, inputs) <= BF16_MAX_REL_ERR
    if HAS_BF16:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*no AVX512-BF16")  # (a CPU without AMX says so)
            fast = tvmdm.compile(tiny_layer, shapes=TINY, precision="bf16", tuning_logs=None)
        np.testing.assert_allclose(slow.run(inputs)[0], fast.run(inputs)[0], rtol=1e-4, atol=1e-5)


def test_bad_precision_is_refused(tiny_layer):
    with pytest.raises(ValueError, match="unknown precision 'int4'"):
        tvmdm.compile(tiny_layer, precision="int4")


def test_symbolic_shapes_in_bf16_one_module_for_every_size(tiny_layer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # this CPU's bf16 path (tiles, AVX512-BF16 or none): tested apart
        compiled = tvmdm.compile(tiny_layer, precision="bf16", tuning_logs=None)
    assert [s.shape[:2] for s in compiled.inputs] == [("batch", "seq")] * 2
    converted = [gv.name_hint for gv, f in compiled.mod.functions_items() if "to_bf16" in gv.name_hint]
    assert converted  # the activations' bf16 bits, their rows padded to whole tiles
    for batch, seq in ((2, 8), (1, 5), (3, 37)):
        inputs = tvmdm.random_inputs(compiled, batch=batch, seq=seq)
        assert compiled.run(inputs)[0].shape == (batch, seq, 32)
        assert _max_rel_err(compiled, inputs) <= BF16_MAX_REL_ERR


def test_bf16_artifact_round_trip(tmp_path, tiny_layer):
    compiled = tvmdm.compile(tiny_layer, shapes=TINY, precision="bf16")
    inputs = tvmdm.random_inputs(compiled, batch=2, seq=8)
    loaded = tvmdm.load(compiled.export(tmp_path / "bf16.tvmdm"))
    np.testing.assert_array_equal(loaded.run(inputs)[0], compiled.run(inputs)[0])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "distilbert", "roberta-seqcls"])
def test_real_hf_exports_in_bf16(hf_export, family):
    path = hf_export(family, dynamo=False, dynamic=False, opset=14)
    compiled = tvmdm.compile(path, precision="bf16")
    assert any("bf16_gemm" in k for k in compiled.kernels)
    assert _max_rel_err(compiled, hf_exports.sample_inputs(family)) <= BF16_MAX_REL_ERR


def _one_matmul_model(m=128, k=256, n=512):
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, m, n])],
        [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fp16_on_cuda_builds_tensor_core_kernels(arch):
    from tests.helpers.cuda import cuda_source as _cuda_source

    model = _one_matmul_model()
    assert "wmma::mma_sync" not in _cuda_source(tvmdm.compile(model, target=f"cuda:{arch}"))
    source = _cuda_source(tvmdm.compile(model, target=f"cuda:{arch}", precision="fp16"))
    assert "wmma::mma_sync" in source and "__half" in source  # fp16 operands on tensor cores


def test_precision_must_suit_the_target(tiny_layer):
    with pytest.raises(ValueError, match="precision='fp16' is built for cuda targets, not llvm; use precision='bf16'"):
        tvmdm.compile(tiny_layer, precision="fp16")


def test_bf16_on_cuda_builds_bf16_kernels():
    from tests.helpers.cuda import cuda_source as _cuda_source

    source = _cuda_source(tvmdm.compile(_one_matmul_model(), target="cuda:sm_80", precision="bf16"))
    assert "nv_bfloat16" in source  # bf16 operands (SIMT: dlight has no bf16 tensor-core rule)


@needs_bf16_cpu
def test_demo_reports_the_bf16_model(capsys):
    from tvmdm.cli.demo import run_demo

    assert run_demo("bert-tiny-layer") == 0
    out = capsys.readouterr().out
    assert "tvmdm bf16 / onnxruntime fp32" in out and "bf16 max rel error (<= 0.01)" in out and "ok" in out


@pytest.mark.skipif(not shipped_logs(make_target("llvm")), reason="no shipped log tuned for this CPU")
def test_shipped_bf16_log_covers_the_bf16_only_kernels():
    from tvmdm.build.shapes import resolve_shapes

    compiled = tvmdm.compile(tvmdm.default_model("bert-base-layer"), precision="bf16", fusion="tvm",
                             shapes=resolve_shapes("bert-base-layer", None, 8, 128))
    hand = {k for k in compiled.kernels if "bf16_gemm" in k}
    assert hand and not hand & set(compiled.tuned_kernels)  # the micro-kernel needs no log
    # Every other kernel of main has a record (the fp32 logs' or the bf16 logs') or a hand-written schedule: none
    # is left to the default schedule (the weight packing runs once at load; the training log covers it too).
    per_call = set(compiled.kernels) - hand - {k for k in compiled.kernels if k.startswith("pack_bf16")}
    covered = set(compiled.tuned_kernels) | set(compiled.hand_kernels)  # softmax, LayerNorm: the row rule's
    assert per_call <= covered, sorted(per_call - covered)


@pytest.fixture(scope="module")
def bf16_layer_step(tiny_layer):
    return tvmdm.compile_train_step(tiny_layer, loss="mse", optimizer=tvmdm.AdamW(lr=1e-2), batch=2, seq=8,
                                    tuning_logs=None, precision="bf16", fusion="tvm")


def test_bf16_training_step_gradients_close_to_torch_fp32(tiny_layer, bf16_layer_step):
    torch = pytest.importorskip("torch")
    from tests.helpers.torch_layer import ours as _ours, rel_err as _rel_err, torch_layer as _torch_layer, torch_layer_loss as _torch_layer_loss

    step = bf16_layer_step
    # Every contraction with a 2-D operand is a bf16 kernel: 6 forward, 6 weight gradients, 3 input gradients
    # (output projection, FFN up and down; the layer input needs none); and the attention's batched ones whose
    # N is a multiple of 16 (context forward, two of its gradients).
    sites = call_sites(step.mod, "train_step")
    assert sum(n for k, n in sites.items() if "bf16_gemm" in k) == 6 + 6 + 3 + 3, sites
    assert "vdpbf16ps" in asm_of(step) or not HAS_BF16
    feeds = tvmdm.random_inputs(step, batch=2, seq=8)
    batch = dict(feeds, labels=np.random.default_rng(1).standard_normal(step.target_spec.shape).astype(np.float32))
    ref, layout = _torch_layer(tiny_layer)
    loss, grads = step.gradients(batch)
    torch_loss = _torch_layer_loss(ref, batch)
    torch_loss.backward()
    assert loss == pytest.approx(torch_loss.item(), rel=1e-3)
    scale = max(p.grad.abs().max().item() for p in ref.module.parameters())
    errors = {name: _rel_err(_ours(grads[layout[name][0]], layout[name][1]), p.grad.numpy(), 1e-3 * scale)
              for name, p in ref.module.named_parameters()}
    assert max(errors.values()) <= BF16_MAX_REL_ERR, errors
    assert errors["attention.self.value.weight"] > 1e-5  # rounded: bf16 really used in the weight gradients
    del torch


def test_bf16_training_lowers_the_loss_and_keeps_fp32_master_weights(bf16_layer_step, tmp_path):
    step = bf16_layer_step
    feeds = tvmdm.random_inputs(step, batch=2, seq=8, seed=3)
    batch = dict(feeds, labels=np.random.default_rng(2).standard_normal(step.target_spec.shape).astype(np.float32))
    state = step.state_dict()
    losses = [step.step(batch) for _ in range(10)]
    assert losses[-1] < 0.7 * losses[0], losses
    weights = {k: v for k, v in step.state_dict().items() if k.startswith("weights/")}
    assert all(v.dtype == np.float32 for v in weights.values())
    # Updates smaller than a bf16 step of the weight still accumulate in the fp32 masters.
    moved = [np.abs(v - state[k]).max() for k, v in weights.items()]
    assert min(moved) > 0
    loaded = tvmdm.load_train_step(step.export(tmp_path / "bf16-step.tar"))
    assert loaded.step(batch) == pytest.approx(step.step(batch), rel=1e-6)


@pytest.mark.slow
def test_dynamic_loss_scaling_skips_overflowing_steps_and_is_exact_otherwise(tiny_layer, tmp_path):
    """Loss scaling (on for fp16, any precision on request) tested in fp32 on the CPU: a scale of 2^127 overflows,
    so steps are skipped (nothing changes but the scale, halved each time) until the gradients are finite; that
    step equals an unscaled one (scaling by a power of two is exact)."""
    options = dict(loss="mse", optimizer=tvmdm.AdamW(lr=1e-2), batch=2, seq=8, tuning_logs=None)
    plain = tvmdm.compile_train_step(tiny_layer, **options)
    scaled = tvmdm.compile_train_step(tiny_layer, loss_scale=tvmdm.LossScaler(scale=2.0 ** 127, interval=2),
                                      **options)
    feeds = tvmdm.random_inputs(plain, batch=2, seq=8)
    labels = 1000 * np.random.default_rng(1).standard_normal(plain.target_spec.shape).astype(np.float32)
    batch = dict(feeds, labels=labels)  # gradients ~10: times 2^127 they overflow
    start = scaled.state_dict()
    losses = []
    while scaled.step_count == 0 and len(losses) < 40:
        losses.append(scaled.step(batch))
    scaler = scaled.loss_scaler
    assert scaler.skipped == len(losses) - 1 >= 1
    assert scaler.scale == 2.0 ** (127 - scaler.skipped)
    assert losses[-1] == pytest.approx(plain.step(batch), rel=1e-6)  # the reported loss is unscaled
    for name, value in plain.state_dict().items():
        np.testing.assert_allclose(scaled.state_dict()[name], value, rtol=1e-6, atol=1e-9, err_msg=name)
        if name.startswith("weights/") and scaler.skipped:
            assert not np.array_equal(value, start[name]) or np.abs(value).max() == 0 or "key.bias" in name
    scaled.step(batch)  # a second finite step in a row: the scale grows (interval=2)
    assert scaled.loss_scaler.scale == 2.0 ** (128 - scaler.skipped)
    loaded = tvmdm.load_train_step(scaled.export(tmp_path / "scaled.tar"))
    assert loaded.loss_scaler == scaled.loss_scaler
    with pytest.raises(ValueError, match="loss_scale must be"):
        tvmdm.compile_train_step(tiny_layer, loss_scale="static", **options)


@pytest.mark.parametrize("arch", ["sm_80"])
def test_fp16_training_step_builds_for_cuda_with_loss_scaling(arch):
    from tests.helpers.cuda import cuda_source as _cuda_source

    step = tvmdm.compile_train_step(_one_matmul_model(), loss="mse", target=f"cuda:{arch}", precision="fp16")
    assert step.loss_scaler is not None and step.loss_scaler.scale == 2.0 ** 16
    source = _cuda_source(step)
    assert "wmma::mma_sync" in source and "__half" in source  # forward and weight gradient on tensor cores
    # the unscale and the skip of a non-finite step live in train_step's AdamW kernel: it reads the scale
    # (apply_update's, for data-parallel steps, does not), and no kernel of its own selects old or new weights
    adamw = re.findall(r"void [^\n]*adamw\w*_kernel\(([^)]*)\)", source)
    assert {"loss_scale_ptr" in params for params in adamw} == {False, True}
    assert not [k for k in re.findall(r"void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source) if "where" in k]
    with pytest.raises(ValueError, match="precision='fp16' is built for cuda targets"):
        tvmdm.compile_train_step(_one_matmul_model(), loss="mse", precision="fp16")
