"""TVM's CUDA tensor intrinsics imported with a stack that carries no source lines (schedules.intrinsics_import)."""
import inspect
import subprocess
import sys

from schedules.intrinsics_import import _frames_without_source


def test_frames_are_inspect_stacks_frames():
    def probe():
        return inspect.stack(), _frames_without_source()

    full, light = probe()
    # the same frames, names and lines, from probe's own outwards (the first differs only in its line)
    assert [f.frame for f in light] == [f.frame for f in full]
    assert [(f.function, f.filename) for f in light] == [(f.function, f.filename) for f in full]
    assert [f.lineno for f in light[1:]] == [f.lineno for f in full[1:]]
    assert all(f.code_context is None for f in light)


def test_import_registers_the_intrinsics_and_restores_inspect():
    # in a fresh process: the module may already be imported in this one
    code = """
import inspect, sys
original = inspect.stack
from schedules.intrinsics_import import CUDA_INTRINSICS, import_cuda_intrinsics
import tvm
assert CUDA_INTRINSICS not in sys.modules
import_cuda_intrinsics()
assert CUDA_INTRINSICS in sys.modules and inspect.stack is original
from tvm.s_tir.tensor_intrin.cuda import LDMATRIX_f16_A_INTRIN, MMA_f16f16f32_INTRIN
for name in (LDMATRIX_f16_A_INTRIN, MMA_f16f16f32_INTRIN):
    assert tvm.s_tir.TensorIntrin.get(name) is not None, name
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
