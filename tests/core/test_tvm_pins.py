"""The TVM / tvm-ffi pins and environment facts tvmdm depends on (tvmdm.core.threads)."""
import subprocess
import sys

import pytest
from importlib import metadata

from tvmdm.core.threads import NUM_THREADS_ENV


def test_pinned_versions():
    assert metadata.version("apache-tvm") == "0.27.0.post1"
    assert metadata.version("apache-tvm-ffi") == "0.1.14.post1"


def test_save_json_with_primfunc_does_not_segfault():
    # tvm-ffi 0.1.15.post2 segfaults here (MetaSchedule needs it); run in a child so a crash fails the test.
    code = ("import tvm\nfrom tvm import relax, te\n"
            "a = te.placeholder((4,), name='a'); b = te.compute((4,), lambda i: a[i] * 2, name='b')\n"
            "mod = tvm.IRModule({'f': te.create_prim_func([a, b])})\n"
            "print(len(tvm.ir.save_json(mod)) > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def test_torch_imports_after_tvm():
    pytest.importorskip("torch")
    code = "import tvm, tvmdm\nimport torch\nprint(torch.cuda.is_available() in (True, False))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def _threads_in_fresh_process(code: str) -> int:
    import os

    env = {k: v for k, v in os.environ.items() if k != NUM_THREADS_ENV}
    out = subprocess.run([sys.executable, "-c", code + "\nimport tvm\nprint(tvm.get_global_func('runtime.NumThreads')())"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.slow
def test_tvm_thread_pool_uses_every_core():
    import os

    cores = len(os.sched_getaffinity(0))
    # Stock: half the hardware threads on x86 (SMT assumed), so 1 thread on this 2-core VM.
    assert _threads_in_fresh_process("") == max(1, os.cpu_count() // 2)
    assert _threads_in_fresh_process("import tvmdm") == cores
    # A user's own setting wins.
    assert subprocess.run([sys.executable, "-c", "import tvmdm, tvm; print(tvm.get_global_func('runtime.NumThreads')())"],
                          env={**os.environ, NUM_THREADS_ENV: "1"}, capture_output=True, text=True,
                          timeout=120, check=True).stdout.split()[-1] == "1"
