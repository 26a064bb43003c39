"""fp32 contractions on packed weights with the hand-written micro-kernel (schedules.packed): what compile uses
on a CPU the shipped logs were not tuned for. Checked against numpy and onnxruntime."""
import json
import warnings

import numpy as np
import pytest
import tvm

import schedules.logs
import tvmdm
from schedules.logs import shipped_logs
from schedules.database import TuningLogWarning
from schedules.packed import PANEL_VECTORS, panel_lanes, schedule_packed_gemm
from tvmdm.models import BertConfig, build_encoder_layer
from tvmdm.transform.kernels import fp32_packing, gemm_func
from tvmdm.analysis.profile import call_sites
from tvmdm.core.target import make_target

# Every contraction dim a whole number of panels for both AVX2 (24 columns) and AVX-512 (48).
LAYER = BertConfig(hidden=96, heads=2, ffn=192, batch=2, seq=16)
SHAPES = {"hidden_states": [2, 16, 96], "attention_mask": [2, 16]}


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("lead,k,n", [((2, 12), 40, 48), ((6,), 64, 96)])
def test_micro_kernel_matches_numpy(lanes, lead, k, n):
    panel = PANEL_VECTORS * lanes
    if n % panel:
        pytest.skip("not a whole number of panels")
    func = schedule_packed_gemm(gemm_func(lead, k, n, packing=fp32_packing(panel)).with_attr("global_symbol",
                                                                                              "main"), lanes)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=make_target("llvm"))
    rng = np.random.default_rng(0)
    a = rng.standard_normal(lead + (k,)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = w.reshape(k, n // panel, panel).transpose(1, 0, 2)[..., None].copy()  # [N/panel, K, panel, 1]
    out = tvm.runtime.tensor(np.zeros(lead + (n,), np.float32))
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(packed), out)
    np.testing.assert_allclose(out.numpy(), a.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fusion", ["tvm", "paper"])
def test_layer_without_logs_packs_its_weights_and_matches_onnxruntime(fusion):
    # No log suits the CPU (tuning_logs=[] is what "shipped" resolves to then): every weight contraction
    # becomes a packed_gemm kernel with the hand schedule, its weights packed once at load.
    compiled = tvmdm.compile(build_encoder_layer(LAYER), shapes=SHAPES, tuning_logs=[], fusion=fusion)
    calls = call_sites(compiled.mod)
    gemms = [k for k in calls if "packed_gemm" in k]
    # Q, K, V, output, FFN up and down (paper: Q, K, V merged into one).
    assert sum(calls[k] for k in gemms) == (4 if fusion == "paper" else 6), calls
    for name in gemms:
        text = compiled.mod[name].script()
        assert "T.parallel" in text and "T.vectorized" in text and "local" in text, name
    result = compiled.check(tvmdm.random_inputs(compiled, batch=2, seq=16))
    assert result.ok, str(result)


def test_explicitly_untuned_compile_keeps_plain_contractions():
    compiled = tvmdm.compile(build_encoder_layer(LAYER), shapes=SHAPES, tuning_logs=None)
    assert not any("packed_gemm" in k for k in compiled.kernels)


def _fake_log(root, name, target):
    (root / name).mkdir()
    (root / name / "meta.json").write_text(json.dumps({"target_kind": "llvm", "target": json.dumps(target)}))


def test_shipped_logs_tuned_for_wider_vectors_are_skipped(tmp_path, monkeypatch):
    avx2 = {"kind": "llvm", "mcpu": "znver4", "mattr": ["-avx512f"]}  # a Zen 4 whose VM hides AVX-512
    _fake_log(tmp_path, "avx2-log", avx2)
    _fake_log(tmp_path, "avx512-log", {"kind": "llvm", "mcpu": "znver4"})
    monkeypatch.setattr(schedules.logs, "SHIPPED_LOGS", str(tmp_path))
    monkeypatch.setattr(schedules.logs, "_WARNED", set())
    with pytest.warns(TuningLogWarning, match=r"avx512-log were tuned for wider vector registers than this CPU's "
                                              r"\(256-bit\): not applied"):
        assert [p.split("/")[-1] for p in shipped_logs(tvm.target.Target(avx2))] == ["avx2-log"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a CPU with more features takes both, without a word
        assert [p.split("/")[-1] for p in shipped_logs(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))] == \
            ["avx2-log", "avx512-log"]
    assert [p.split("/")[-1] for p in shipped_logs("llvm")] == ["avx2-log", "avx512-log"]  # by kind: all
    # A feature outside the vector width (GFNI hidden by a VM) does not make a log unfit.
    assert len(shipped_logs(tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-gfni"]}))) == 2


def test_contractions_are_packed_unless_a_log_was_tuned_on_this_cpu_model(tmp_path):
    from schedules.logs import tuned_on_this_cpu
    from tvmdm.build.options import packed_lanes

    _fake_log(tmp_path, "zen4", {"kind": "llvm", "mcpu": "znver4"})
    (tmp_path / "users").mkdir()  # a log a user tuned and passed: no meta.json, taken to be tuned here
    zen4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
    xeon = tvm.target.Target({"kind": "llvm", "mcpu": "rocketlake", "mattr": ["+avx512bf16"]})  # a SPR VM
    assert tuned_on_this_cpu(tmp_path / "zen4", zen4) and not tuned_on_this_cpu(tmp_path / "zen4", xeon)
    assert tuned_on_this_cpu(tmp_path / "users", xeon)
    assert packed_lanes([str(tmp_path / "zen4")], zen4, "fp32") is None
    assert packed_lanes([str(tmp_path / "zen4")], xeon, "fp32") == 48  # the Zen 4 records serve the rest
    assert packed_lanes([str(tmp_path / "zen4"), str(tmp_path / "users")], xeon, "fp32") is None
    assert packed_lanes([], xeon, "fp32") == 48 and packed_lanes(None, xeon, "fp32") is None
    assert packed_lanes([str(tmp_path / "zen4")], xeon, "bf16") is None  # bf16 has its own micro-kernel


def test_panel_width_follows_the_vector_registers():
    assert panel_lanes(tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-avx512f"]})) == 24
    assert panel_lanes(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})) == 48


@pytest.mark.slow
@pytest.mark.parametrize("fusion", ["tvm", "paper"])
def test_training_step_without_logs_packs_each_step_and_matches_the_plain_step(fusion):
    # Forward and input-gradient contractions pack their 2-D operand per step (the weights change), each weight
    # gradient X^T dY reads a transposed copy of X; the numbers are those of the plain kernels.
    rng = np.random.default_rng(0)
    batch = {"hidden_states": rng.standard_normal((2, 16, 96)).astype(np.float32),
             "attention_mask": np.ones((2, 16), np.int64),
             "target": rng.standard_normal((2, 16, 96)).astype(np.float32)}
    model = build_encoder_layer(LAYER)
    packed = tvmdm.compile_train_step(model, loss="mse", batch=2, seq=16, tuning_logs=[], fusion=fusion)
    plain = tvmdm.compile_train_step(model, loss="mse", batch=2, seq=16, tuning_logs=None, fusion=fusion)
    calls = call_sites(packed.mod, "train_step")
    assert not any("matmul_tn" in k for k in calls), calls  # every weight gradient is a packed contraction
    # 6 forward, 3 input gradients (output, FFN down and up; the layer's input is not trained, so Q/K/V pass
    # none back) and 6 weight gradients; paper fusion merges Q, K, V: 4 forward, 4 weight gradients
    assert sum(n for k, n in calls.items() if "packed_gemm" in k) == (11 if fusion == "paper" else 15), calls
    for name in calls:
        if any(word in name for word in ("packed_gemm", "pack_weight", "transpose_rows")):
            # by our schedules, not the default rule's fallback (which is parallel too): the merged QKV's
            # concatenation once made the pack rule raise, unnoticed
            assert name in packed.hand_kernels and "T.parallel" in packed.mod[name].script(), name
    loss, grads = packed.gradients(batch)
    want_loss, want = plain.gradients(batch)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for name, g in want.items():
        np.testing.assert_allclose(grads[name], g, rtol=1e-5, atol=1e-6 * float(np.abs(g).max()), err_msg=name)
