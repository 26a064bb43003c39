"""The benchmark harness on a tiny model: outputs checked first, timings and kernel rows reported, JSON written.
No timing assertions."""
import json

import numpy as np
import pytest

import tvmdm
from tvmdm import profile
from tvmdm.bench import run_bench


def test_bench_tiny_layer_writes_json(tmp_path):
    lines = []
    path = tmp_path / "bench.json"
    result = run_bench("bert-tiny-layer", batch=2, seq=8, repeat=3, untuned=True, json_path=str(path),
                       out=lines.append)
    data = json.loads(path.read_text())
    assert data["shapes"] == {"hidden_states": [2, 8, 32], "attention_mask": [2, 8]}
    assert [t["system"] for t in data["timings"]] == ["onnxruntime", "tvmdm", "tvmdm-untuned"]
    assert all(t["p10_ms"] <= t["median_ms"] <= t["p90_ms"] for t in data["timings"])
    assert data["gemm_peak_gflops"] > 0 and data["machine"]["tvm"] == "0.27.0.post1"
    names = {k["name"] for k in data["kernels"]}
    assert names == set(result["kernels"][i]["name"] for i in range(len(names)))
    assert any(line.startswith("onnxruntime") for line in lines)


def test_kernel_flops_and_call_sites_are_exact():
    # Tiny layer, B=2, S=8, H=32, 2 heads of 16, FFN 64: closed-form flops of the contractions.
    compiled = tvmdm.compile(tvmdm.default_model("bert-tiny-layer"),
                             shapes={"hidden_states": [2, 8, 32], "attention_mask": [2, 8]}, tuning_logs=None)
    rows = {r.name: r for r in profile.profile_kernels(compiled.mod, compiled.target, measure=False)}
    calls = profile.call_sites(compiled.mod)
    assert sum(calls.values()) == sum(r.calls for r in rows.values())
    b, s, h, ffn = 2, 8, 32, 64
    contraction_flops = sum(r.flops * r.calls for r in rows.values() if r.is_contraction)
    # QKV + output projection + FFN (2 matmuls) + scores + context, plus their fused element-wise work.
    matmul_only = 4 * 2 * b * s * h * h + 2 * 2 * b * s * h * ffn + 2 * 2 * b * s * s * h
    assert matmul_only <= contraction_flops <= matmul_only * 1.5  # plus fused epilogues (GELU polynomial)


def test_bench_refuses_wrong_answers(monkeypatch):
    from tvmdm import build

    monkeypatch.setattr(build.Compiled, "run", lambda self, feeds: [np.zeros((2, 8, 32), np.float32)])
    with pytest.raises(AssertionError, match="tvmdm disagrees with onnxruntime before timing"):
        run_bench("bert-tiny-layer", batch=2, seq=8, repeat=1, kernels=False, out=lambda line: None)
