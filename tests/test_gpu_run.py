"""The prepared GPU session script, run here where there is no GPU: it must say so, take the CPU path through
every step (tune under a deadline, benchmark with the tuned log) and leave its JSON, plot, log and database."""
import json
import subprocess
import sys

import pytest


def test_gpu_run_without_gpu_falls_back_to_cpu_and_writes_everything(tmp_path):
    import tvm

    if tvm.cuda(0).exist:
        pytest.skip("a GPU is present: the fall-back path is not taken")
    cmd = [sys.executable, "-m", "tvmdm.gpu_run", str(tmp_path), "--model", "bert-tiny-layer", "--batch", "2",
           "--seq", "8", "--budget", "120", "--trials", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_run.json").read_text())
    run = data["gpu_run"]
    assert run["fallback"].startswith("no CUDA device") and data["target"] == "llvm"
    assert run["tuning"]["status"] == "finished" and run["tuning"]["records"] >= 1
    assert (tmp_path / "tuning_logs" / "database_tuning_record.json").exists()
    assert data["tuned_kernels"], "the records tuned in this run were not applied"
    systems = [t["system"] for t in data["timings"]]
    assert systems[:1] == ["onnxruntime"] and {"tvmdm", "tvmdm-untuned"} <= set(systems)
    assert (tmp_path / "gpu_run.png").read_bytes()[:4] == b"\x89PNG"
    log = (tmp_path / "gpu_run.log").read_text()
    assert "NOTE: no CUDA device" in log and "wrote gpu_run.json" in log
    assert "tasks; 0 trials already in" in log  # the tuner's own output is in the log
