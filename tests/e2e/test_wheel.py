"""The package as a user installs it: a wheel (not ``-e``) in a fresh virtualenv carries the shipped tuning logs,
pruned to what a compile applies, and compiles with them; the core install (no extras) compiles and runs, and
what needs an extra says which.

The fresh environment gets its dependencies from this one through a path file (only the wheel's own files
are new; pip installs the wheel alone), and runs from a folder outside the source tree.
"""
import json
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ZEN4_CPUINFO = os.path.join(ROOT, "tests", "data", "cpuinfo", "zen4")

IN_THE_WHEEL = textwrap.dedent("""
    import json, os, sys
    import tvm
    import tvmdm
    import schedules.logs
    from schedules.log_lines import RECORDS, WORKLOADS
    from tvmdm.core.target import host_flags, llvm_target

    site = sys.argv[1]
    logs = schedules.logs.SHIPPED_LOGS
    records = {name: sum(1 for _ in open(os.path.join(logs, name, RECORDS))) for name in sorted(os.listdir(logs))
               if os.path.isfile(os.path.join(logs, name, RECORDS))}
    workloads = {name: sum(1 for _ in open(os.path.join(logs, name, WORKLOADS))) for name in records}
    # code built for a Zen 4 with AVX-512 (the logs' CPU) on any machine: the logs apply to it
    target = tvm.target.Target(llvm_target("znver4", host_flags(sys.argv[2]), **{"num-cores": 2}))
    model = tvmdm.default_model("bert-base-layer")
    compiled = tvmdm.compile(model, target=target, shapes={"hidden_states": [8, 128, 768], "attention_mask": [8, 128]})
    print(json.dumps({"tvmdm": os.path.dirname(tvmdm.__file__), "logs": logs, "records": records,
                      "workloads": workloads, "tuned": sorted(compiled.tuned_kernels)}))
""")

WITHOUT_EXTRAS = textwrap.dedent("""
    import sys
    for name in ("xgboost", "psutil", "cloudpickle", "tornado", "matplotlib", "torch"):
        sys.modules[name] = None  # a core install: none of the extras
    import tvmdm
    compiled = tvmdm.compile(tvmdm.default_model("bert-tiny-layer"))
    inputs = tvmdm.random_inputs(compiled, batch=1, seq=8)
    assert compiled.check(inputs).ok
    from tvmdm.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    """(python of a fresh virtualenv holding the built wheel, its site-packages)."""
    tmp = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp / "dist"), ROOT], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp / "dist").glob("tvmdm-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # this environment's packages (TVM, onnx, ...) seen from the fresh one; not processed as a site dir, so this
    # checkout's editable install stays invisible there
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(sysconfig.get_path("purelib") + "\n")
    # without PYTHONPATH: a checkout on it (its tvmdm.egg-info) reads as tvmdm installed, and pip skips the wheel
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q",
                                str(wheel)], capture_output=True, text=True, timeout=600, env=_without_pythonpath())
    assert installed.returncode == 0, installed.stderr[-3000:]
    return python, site, tmp


def _without_pythonpath() -> dict:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(python, code_or_args, cwd, *args, timeout=600):
    argv = [python, "-c", code_or_args, *args] if isinstance(code_or_args, str) else [python, *code_or_args]
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=_without_pythonpath(), timeout=timeout)


@pytest.mark.slow
def test_the_wheel_carries_pruned_logs_and_compiles_with_them(fresh_venv):
    python, site, tmp = fresh_venv
    done = _run(python, IN_THE_WHEEL, tmp, site, ZEN4_CPUINFO)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["tvmdm"].startswith(site) and found["logs"].startswith(site)  # the wheel's, not this checkout's
    shipped = sorted(n for n in os.listdir(os.path.join(ROOT, "tuning_logs")) if os.path.isfile(
        os.path.join(ROOT, "tuning_logs", n, "database_tuning_record.json")))
    assert sorted(found["records"]) == shipped
    for name, count in found["records"].items():  # one record per kernel: the best, what compile applies
        with open(os.path.join(ROOT, "tuning_logs", name, "database_tuning_record.json")) as f:
            assert count <= found["workloads"][name] < sum(1 for _ in f), name
    assert len(found["tuned"]) >= 5, found["tuned"]  # the contractions and more got the logs' schedules


@pytest.mark.slow
def test_the_core_install_compiles_and_names_the_extra_a_command_needs(fresh_venv, tmp_path):
    python, _, tmp = fresh_venv
    version = _run(python, ["-m", "tvmdm", "--version"], tmp)
    assert version.returncode == 0 and version.stdout.startswith("tvmdm 0."), version.stdout + version.stderr
    tune = _run(python, WITHOUT_EXTRAS, tmp, "tune", "bert-tiny-layer", "--logs", str(tmp_path / "logs"),
                "--trials", "1", "--batch", "1", "--seq", "8")
    assert tune.returncode == 2, tune.stderr[-3000:]
    last = tune.stderr.strip().splitlines()[-1]
    assert last.startswith("tvmdm tune: error: tuning needs xgboost, psutil, cloudpickle (not installed): "
                           "pip install 'tvmdm[tune]'"), last
