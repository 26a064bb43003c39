"""The prepared GPU session script, run here where there is no GPU: it must say so, take the CPU path through
every step in order (check, benchmark, training step, tuning under a deadline, benchmark with the tuned log)
and leave its JSON (each step's result), plot, log and database."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # end to end, a minute or more in all (`pytest -m 'not slow'` skips it)


def test_gpu_run_without_gpu_falls_back_to_cpu_and_writes_everything(tmp_path):
    import tvm

    if tvm.cuda(0).exist:
        pytest.skip("a GPU is present: the fall-back path is not taken")
    cmd = [sys.executable, "-m", "tvmdm.bench.gpu_run", str(tmp_path), "--model", "bert-tiny-layer", "--batch", "2",
           "--seq", "8", "--budget", "90", "--trials", "400"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    data = json.loads((tmp_path / "gpu_run.json").read_text())
    assert data["fallback"].startswith("no CUDA device") and data["target"] == "llvm"
    steps = data["steps"]
    assert list(steps) == ["check", "bench", "train", "tune", "tuned"]  # in this order, none failed
    assert not any("error" in s for s in steps.values()), steps
    assert steps["check"]["result"]["fp32"]["ok"]
    bench = steps["bench"]["result"]
    assert [t["system"] for t in bench["timings"]][:1] == ["onnxruntime"]
    assert {"tvmdm", "torch-eager"} <= {t["system"] for t in bench["timings"]}
    train = steps["train"]["result"]
    assert {"tvmdm", "torch-eager"} <= {t["system"] for t in train["timings"]}
    # 400 trials would take far longer: the deadline ended it, keeping every batch it measured, at least the
    # first. Its own deadline as a rule; on a loaded machine a batch in flight may overrun the script's margin
    # and the script's SIGINT ends it (the same records kept). The tuner's deadline rule itself is tested with
    # a fake clock in tests/tune/test_scheduler.py, the SIGTERM path in tests/tune/test_tuning.py.
    tuning = steps["tune"]["result"]
    assert (tuning["status"], tuning["exit_code"]) in {("finished", 0), ("interrupted after its deadline", 130)}
    assert tuning["records"] >= 1
    assert (tmp_path / "tuning_logs" / "database_tuning_record.json").exists()
    assert steps["tuned"]["result"]["tuned_kernels"], "the records tuned in this run were not applied"
    assert {"tvmdm", "tvmdm-untuned"} <= {t["system"] for t in steps["tuned"]["result"]["timings"]}
    assert (tmp_path / "gpu_run.png").read_bytes()[:4] == b"\x89PNG"
    log = (tmp_path / "gpu_run.log").read_text()
    assert "NOTE: no CUDA device" in log and "wrote gpu_run.json" in log
    assert "stopped (deadline of" in log or "interrupted: the records measured so far" in log  # the tuner's
