"""The llvm target describes the CPU we run on, features included (a VM may hide some of its model's)."""
import subprocess
import sys

import tvm

from tvmdm.core.target import extra_host_features, host_flags, host_llvm_target, make_target, missing_host_features


def test_features_the_host_lacks_are_switched_off(tmp_path):
    # A Zen 4 whose hypervisor hides AVX-512: LLVM still calls it znver4, whose features include AVX-512.
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 vaes "
                       "vpclmulqdq\n")
    missing = missing_host_features("znver4", host_flags(str(cpuinfo)))
    assert {"avx512f", "avx512bf16", "avx512vl"} <= set(missing)
    assert not {"avx", "avx2", "fma", "f16c"} & set(missing)
    # Linux spells some flags with underscores (avx512_bf16): the same feature as LLVM's avx512bf16.
    cpuinfo.write_text("flags\t: " + " ".join(["sse", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16",
                                              "avx512vl", "avx512bw", "avx512dq", "avx512cd", "avx512ifma",
                                              "avx512vbmi", "avx512_vbmi2", "avx512_vnni", "avx512_bitalg",
                                              "avx512_vpopcntdq", "gfni", "vaes", "vpclmulqdq"]) + "\n")
    assert missing_host_features("znver4", host_flags(str(cpuinfo))) == []
    assert missing_host_features("znver4", host_flags(str(tmp_path / "absent"))) == []  # no /proc: trust LLVM


def test_features_the_model_lacks_are_switched_on(tmp_path):
    # A Sapphire Rapids VM that calls itself "Intel Xeon Processor": LLVM's rocketlake, without AVX512-BF16/AMX.
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t: sse avx avx2 fma avx512f avx512bw avx512vl avx512_bf16 amx_tile amx_bf16 "
                       "avx512_fp16 pdpe1gb\n")
    extra = extra_host_features("rocketlake", host_flags(str(cpuinfo)))
    assert {"avx512bf16", "amx-tile", "amx-bf16", "avx512fp16"} <= set(extra)
    assert not {"avx512f", "avx2", "avx512vl"} & set(extra)  # rocketlake has those already
    assert extra_host_features("sapphirerapids", host_flags(str(cpuinfo))) == []
    assert extra_host_features("rocketlake", None) == []


def test_host_target_spells_both_directions(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t: sse avx avx2 fma f16c avx512_bf16\n")
    import tvmdm.core.target as target_module

    monkeypatch.setattr(target_module, "host_cpu", lambda: "znver3")  # AVX2 model, no AVX-512
    monkeypatch.setattr(target_module, "host_flags", lambda: host_flags(str(cpuinfo)))
    mattr = host_llvm_target()["mattr"]
    assert "+avx512bf16" in mattr and not any(m.startswith("-avx2") for m in mattr)


def test_host_target_matches_proc_cpuinfo():
    target = make_target("llvm")
    flags = host_flags()
    if flags is None:
        return
    has = tvm.target.codegen.target_has_features
    assert bool(has("avx512f", target)) == ("avx512f" in flags)
    assert bool(has("avx2", target)) == ("avx2" in flags)
    assert bool(has("avx512bf16", target)) == ("avx512bf16" in flags)
    assert bool(has("amx-tile", target)) == ("amxtile" in flags)


KERNEL_SCRIPT = """
import numpy as np, tvm
from tvm.script import tirx as T
from tvmdm.core.target import make_target

@T.prim_func(s_tir=True)
def scale(a: T.Buffer((4096,), "float32"), b: T.Buffer((4096,), "float32")):
    for i in T.vectorized(4096):
        with T.sblock("b"):
            vi = T.axis.spatial(4096, i)
            b[vi] = a[vi] * T.float32(3) + T.float32(1)

lib = tvm.compile(tvm.IRModule({"main": scale}), target=make_target("llvm"))
x = np.random.default_rng(0).standard_normal(4096).astype("float32")
out = tvm.runtime.tensor(np.zeros(4096, "float32"))
lib["main"](tvm.runtime.tensor(x), out)
np.testing.assert_allclose(out.numpy(), x * 3 + 1, rtol=1e-6, atol=1e-6)  # FMA rounds once
print("ran")
"""


def test_vectorized_kernel_runs_on_this_cpu(tmp_path):
    # Built for the host target, a wide vector loop must run: it died with SIGILL on a znver4 VM without
    # AVX-512. In a child process, so a crash fails this test rather than the whole run.
    script = tmp_path / "kernel.py"  # TVMScript reads its source: a file, not -c
    script.write_text(KERNEL_SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ran" in result.stdout, (result.returncode, result.stderr[-2000:])


def test_cpuinfo_file_from_the_environment_narrows_the_host_target(monkeypatch):
    # TVMDM_CPUINFO: build (and run the suite) as on a machine of this model whose VM hides AVX-512
    import os

    from tvmdm.core.target import features_missing_here

    zen4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
    monkeypatch.setenv("TVMDM_CPUINFO", os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "cpuinfo", "zen4-avx2"))
    assert "avx512f" not in host_flags() and "avx2" in host_flags()
    assert not tvm.target.codegen.target_has_features("avx512f", make_target("llvm"))
    assert {"avx512f", "avx512bf16"} <= set(features_missing_here(zen4))
