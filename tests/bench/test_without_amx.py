"""tvmdm bench --no-amx (tvmdm.bench.without_amx): the tile state refused to the benchmark processes by a
seccomp filter, tvmdm built from the CPU's flags without AMX."""
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import onnx
import pytest

from tvmdm.bench import without_amx
from tvmdm.bench.inference import compare_systems
from tvmdm.bench.machine import machine_info
from tvmdm.build.check import ort_session
from tvmdm.bench.isolated import Job, run_jobs
from tvmdm.core.target import host_flags

X86_LINUX = platform.system() == "Linux" and platform.machine() == "x86_64"


def test_the_flags_lose_amx_and_nothing_else():
    text = ("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 avx512_bf16 amx_tile amx_int8\nbugs\t\t: amx_x\n"
            "processor\t: 1\nflags\t\t: fpu amx_tile avx2\n")
    assert without_amx.flags_without_amx(text) == (
        "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\nbugs\t\t: amx_x\nprocessor\t: 1\nflags\t\t: fpu avx2\n")


@pytest.mark.skipif(not X86_LINUX, reason="the seccomp filter is for x86-64 Linux")
def test_the_filter_refuses_the_tile_state_request_to_the_process_and_its_children():
    # run in a process of its own: a seccomp filter cannot be taken back
    code = textwrap.dedent("""
        import ctypes, subprocess, sys
        from tvmdm.bench.without_amx import deny_tile_state
        from tvmdm.core.errors import TvmdmError
        from tvmdm.runtime import amx
        libc = ctypes.CDLL(None, use_errno=True)
        request = "import ctypes; libc = ctypes.CDLL(None, use_errno=True); r = libc.syscall(158, 0x1023, 18); " \\
                  "print(r, ctypes.get_errno())"
        deny_tile_state()
        mask = ctypes.c_ulong(0)
        print("get", libc.syscall(158, 0x1022, ctypes.byref(mask)))  # arch_prctl's other requests go through
        print("request", libc.syscall(158, 0x1023, 18), ctypes.get_errno())
        print("child", subprocess.run([sys.executable, "-c", request], capture_output=True, text=True).stdout.strip())
        try:
            amx.request_tile_state()
        except TvmdmError as err:
            print("tvmdm:", err)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "get 0"
    assert lines[1] == "request -1 1"  # EPERM
    assert lines[2] == "child -1 1"
    assert lines[3].startswith("tvmdm: Linux refused this process the AMX tile state") and "EPERM" in lines[3]


@pytest.mark.slow
@pytest.mark.skipif(not X86_LINUX, reason="the seccomp filter is for x86-64 Linux")
def test_bench_without_amx_builds_no_tile_kernel_and_denies_every_benchmark_process(tiny_layer):
    # 64 rows of 32 columns: bf16 contractions of whole tiles, on AMX where the CPU has it and the option is off
    proto, shapes = tiny_layer, {"hidden_states": [2, 32, 32], "attention_mask": [2, 32]}
    names = (without_amx.DENY_ENV, without_amx.CPUINFO_ENV)
    before = {name: os.environ.get(name) for name in names}
    assert before[without_amx.DENY_ENV] is None
    with without_amx.without_amx():
        assert not any(f.startswith("amx") for f in host_flags())
        assert not any(f.startswith("amx") for f in machine_info(1)["cpu"]["flags"])
        result = compare_systems("bert-tiny-layer", proto, shapes, precisions=("fp32", "bf16"), torch=False,
                                 ort_optimized=False, min_runs=2, max_seconds=1, out=lambda line: None)
        assert set(result["compiled"]) == {"tvmdm", "tvmdm[bf16]"}
        assert not any(c.uses_amx for c in result["compiled"].values())  # bf16 on AVX512-BF16 or fp32, not tiles
        feeds = {"hidden_states": np.zeros((2, 32, 32), np.float32), "attention_mask": np.ones((2, 32), np.int64)}
        with tempfile.TemporaryDirectory() as tmp:
            model = os.path.join(tmp, "layer.onnx")
            onnx.save(proto, model)
            job = {"onnxruntime": Job("onnxruntime", {"model": model, "threads": 1})}
            reference = ort_session(proto, 1).run(None, feeds)
            assert run_jobs(job, feeds, reference, min_runs=1, max_seconds=1)["onnxruntime"]["tile_state_denied"]
            assert {name: os.environ.get(name) for name in before} != before
            with pytest.MonkeyPatch.context() as unset:  # as before the option
                for name in before:
                    unset.delenv(name, raising=False)
                assert run_jobs(job, feeds, reference, min_runs=1, max_seconds=1)["onnxruntime"][
                    "tile_state_denied"] is False  # without the option
    assert {name: os.environ.get(name) for name in before} == before


@pytest.mark.slow
@pytest.mark.skipif(not X86_LINUX, reason="the seccomp filter is for x86-64 Linux")
def test_the_command_line_option_says_so_and_records_the_flags_it_built_for(tmp_path, capsys):
    from tvmdm.cli.main import main

    path = tmp_path / "b.json"
    assert main(["bench", "bert-tiny-layer", "--batch", "2", "--seq", "8", "--no-amx", "--no-torch", "--no-ort-opt",
                 "--no-kernels", "--min-runs", "1", "--max-seconds", "1", "--json", str(path)]) == 0
    assert "--no-amx: every system runs without the AMX tile units" in capsys.readouterr().out
    flags = json.loads(path.read_text())["machine"]["cpu"]["flags"]
    assert "avx2" in flags and not any(f.startswith("amx") for f in flags)
    assert os.environ.get(without_amx.DENY_ENV) is None
