"""The lent-GPU session, tested here without a GPU: compile here, run there with TVM's runtime alone.

The tiny plan is compiled for llvm, and its run goes through the very path a GPU run takes: the runtime
unpacked from runtime.tar.xz (no compiler), TVM_USE_RUNTIME_LIB=1, weights rebuilt from the model's seed and
checked, outputs and losses against PyTorch, device-side and end-to-end timings, one JSON report."""
import json
import os
import re
import subprocess
import sys
import tarfile

import pytest

from tvmdm.bench import gpu_plan, gpu_prepare
from tvmdm.bench.gpu_plan import GpuConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_plan_configs_round_trip_and_the_budget_takes_parts_in_order():
    plan = gpu_plan.DEFAULT_PLAN
    assert [GpuConfig.from_json(c.to_json()) for c in plan] == list(plan)
    assert len({c.name for c in plan}) == len(plan)
    assert plan[0].model == "bert-base-layer" and plan[0].precision == "fp16"  # the first target first
    everything = sum(gpu_plan.config_cost(c, False) for c in plan)
    taken, left_out = gpu_plan.fits(plan, everything, torch_compile=False)
    assert taken == list(plan) and not left_out
    taken, left_out = gpu_plan.fits(plan, everything - 1, torch_compile=False)
    assert left_out and taken + left_out != list(plan) or taken == list(plan)[:len(taken)]
    assert sum(gpu_plan.config_cost(c, False) for c in taken) <= everything - 1
    # torch.compile costs its compile per inference part: fewer parts fit the same budget
    assert len(gpu_plan.fits(plan, everything, torch_compile=True)[0]) < len(plan)
    # the default plan fits the default budget (one device call, at most 600 s) with torch.compile
    assert gpu_plan.plan_cost(plan, torch_compile=True) <= gpu_plan.DEFAULT_BUDGET_S < 600


def test_weights_digest_sees_any_change():
    import numpy as np

    a = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}
    same = {"b": np.zeros(3, np.float32), "w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    assert gpu_plan.weights_digest(a) == gpu_plan.weights_digest(same)  # order of the dict does not matter
    for changed in ({**a, "b": np.ones(3, np.float32)}, {**a, "w": a["w"].reshape(3, 2)},
                    {**a, "w": a["w"].astype(np.float64)}, {"w": a["w"]}):
        assert gpu_plan.weights_digest(changed) != gpu_plan.weights_digest(a)


def test_runtime_bundle_leaves_the_compiler_out_and_fits_one_call(tmp_path):
    path = tmp_path / "runtime.tar.xz"
    size = gpu_prepare.write_runtime(str(path), None)
    with tarfile.open(path) as tar:
        names = tar.getnames()
    assert "site/tvm/lib/libtvm_runtime.so" in names and "site/tvm/lib/libtvm_runtime_cuda.so" in names
    assert "site/tvm/__init__.py" in names
    assert not [n for n in names if "libtvm_compiler" in n or "/3rdparty/" in n]
    # tvm-ffi's wheel adds 2 MiB, the default plan's libraries 13 (measured when prepared for sm_90), checked
    # again by gpu_prepare itself, which refuses a folder over the limit
    assert size + gpu_prepare.tree_bytes() + 20 * 2**20 <= gpu_plan.CARRY_LIMIT


def test_prepare_refuses_a_run_folder_over_one_call(tmp_path):
    (tmp_path / "big.so").write_bytes(b"\0" * (gpu_plan.CARRY_LIMIT - gpu_plan.TREE_MARGIN + 1))
    with pytest.raises(SystemExit, match=r"over the 64 MiB one device call carries \(biggest: big.so"):
        gpu_prepare.check_sizes(str(tmp_path), tree=0)
    (tmp_path / "big.so").write_bytes(b"\0" * 1024)
    gpu_prepare.check_sizes(str(tmp_path), tree=gpu_plan.CARRY_LIMIT - gpu_plan.TREE_MARGIN)  # fits: no error


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The tiny plan compiled for llvm, and TVM's runtime unpacked as the GPU machine unpacks it."""
    run = tmp_path_factory.mktemp("run")
    assert gpu_prepare.main(["--out", str(run), "--target", "llvm", "--plan", "tiny", "--ffi-wheel", "none"]) == 0
    site = tmp_path_factory.mktemp("site")
    with tarfile.open(run / "runtime.tar.xz") as tar:
        tar.extractall(site, filter="data")
    return run, site / "site"


def _run(run, site, out, *args):
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}", TVM_USE_RUNTIME_LIB="1")
    return subprocess.run([sys.executable, "-m", "tvmdm.bench.gpu_run", str(run), str(out), *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def test_prepared_plan_runs_with_the_runtime_alone(prepared, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    run, site = prepared
    plan = json.loads((run / "plan.json").read_text())
    assert plan["target"] == "llvm" and plan["preflight"] == gpu_plan.PREFLIGHT.name
    # the preflight model is also the plan's first part: compiled once, listed once
    assert sorted(p.name for p in run.iterdir()) == sorted(
        ["plan.json", "runtime.tar.xz"] + [f"{c.name}.{ext}" for c in gpu_plan.TINY_PLAN for ext in ("so", "json")])
    done = _run(run, site, tmp_path, "--device", "cpu", "--no-torch-compile", "--repeat", "3", "--budget", "300")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_run.json").read_text())
    pre = report["preflight"]
    assert pre["runtime_only"] and pre["libraries"] == ["tvm_runtime"]  # TVM's compiler never loaded
    assert pre["tvm"].startswith(str(site))  # the unpacked runtime, not this environment's TVM
    assert pre["check"]["ok"]
    infer, train = (report["configs"][c.name] for c in gpu_plan.TINY_PLAN)
    assert infer["ok"] and infer["max_rel_err"] <= 1e-4
    assert set(infer["device_ms"]) == {"tvmdm", "torch-eager"} and all(v > 0 for v in infer["device_ms"].values())
    assert infer["end_to_end_ms"]["tvmdm"] > 0
    assert train["ok"] and len(train["losses"]["tvmdm"]) == 2
    assert set(train["device_ms"]) == {"tvmdm", "torch-eager"}
    assert "done in" in (tmp_path / "gpu_run.log").read_text()


def test_weights_that_do_not_match_their_digest_are_refused(prepared, tmp_path):
    pytest.importorskip("torch")
    run, site = prepared
    bad = tmp_path / "run"
    bad.mkdir()
    for p in run.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    name = gpu_plan.TINY_PLAN[1].name
    entry = json.loads((bad / f"{name}.json").read_text())
    entry["weights"]["sha256"] = "0" * 64
    (bad / f"{name}.json").write_text(json.dumps(entry))
    done = _run(bad, site, tmp_path / "out", "--device", "cpu", "--no-torch-compile", "--repeat", "2")
    assert done.returncode == 1
    report = json.loads((tmp_path / "out" / "gpu_run.json").read_text())
    assert "differ from those it was compiled with" in report["configs"][name]["error"]
    assert report["configs"][gpu_plan.TINY_PLAN[0].name]["ok"]  # the other part still ran


def test_preflight_fails_in_seconds_without_a_usable_gpu(prepared, tmp_path):
    pytest.importorskip("torch")
    import tvm

    if tvm.cuda(0).exist:
        pytest.skip("a GPU is present here: the preflight passes")
    run, site = prepared
    done = _run(run, site, tmp_path, "--device", "cuda")
    assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_run.json").read_text())
    # which of them: no libcudart, no driver (libcuda.so.1: here), TVM's CUDA runtime not loadable, or loaded
    # with no device behind it; said, and nothing else ran
    error = report["preflight_error"]
    assert error.startswith("PreflightError: ")
    assert re.search(r"libcudart\.so\.13 not found|libcuda\.so\.1 \(the NVIDIA driver\) not found|"
                     r"libtvm_runtime_cuda\.so does not load: \S+|tvm\.cuda\(0\) does not exist", error), error
    assert report["configs"] == {}
    assert "PREFLIGHT FAILED" in (tmp_path / "gpu_run.log").read_text()
