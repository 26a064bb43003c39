"""schedules.dpbf16ps: the AVX512-BF16 dot product TVM 0.27 cannot emit from TIR."""
import subprocess
import sys

import numpy as np
import pytest

from schedules.dpbf16ps import DPBF16PS_FUNCTION, DPBF16PS_LLVM


_BF16_DOT_STOCK = '''
import tvm, tvmdm
from tvm.script import tirx as T
from tvmdm.core.target import make_target

@T.prim_func(s_tir=True)
def f(a: T.Buffer((32,), "int16"), b: T.Buffer((32,), "int16"), c: T.Buffer((16,), "float32")):
    T.func_attr({"global_symbol": "main"})
    c[T.ramp(0, 1, 16)] = T.call_llvm_pure_intrin(
        T.llvm_lookup_intrinsic_id("llvm.x86.avx512bf16.dpbf16ps.512"), c.vload([0], "float32x16"),
        a.vload([0], "int16x32"), b.vload([0], "int16x32"), dtype="float32x16")
tvm.compile(tvm.IRModule({"main": f}), target=make_target("llvm"))
'''

def test_bf16_dot_product_needs_the_imported_llvm_function(tmp_path):
    # Stock: the intrinsic on integer vectors is rejected by LLVM's verifier (no bitcast to <32 x bfloat>).
    script = tmp_path / "stock_dpbf16ps.py"  # TVMScript wants a source file
    script.write_text(_BF16_DOT_STOCK)
    stock = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert stock.returncode != 0 and "does not match function signature" in stock.stdout + stock.stderr
    # Workaround: the imported LLVM function compiles and computes the dot product.
    import tvm
    from tvm.script import tirx as T

    from tvmdm.core.target import make_target

    @T.prim_func(s_tir=True)
    def dot(a: T.Buffer((32,), "uint16"), b: T.Buffer((32,), "uint16"), c: T.Buffer((16,), "float32")):
        T.func_attr({"global_symbol": "main"})
        with T.attr(0, "pragma_import_llvm", DPBF16PS_LLVM):
            c[T.ramp(0, 1, 16)] = T.call_pure_extern(
                "float32x16", DPBF16PS_FUNCTION, c.vload([0], "float32x16"),
                T.reinterpret(a.vload([0], "uint16x32"), dtype="int32x16"),
                T.reinterpret(b.vload([0], "uint16x32"), dtype="int32x16"))

    from schedules.bf16 import has_bf16_dot

    target = make_target("llvm")
    if not has_bf16_dot(target):  # build it for a CPU that has the instruction; run it only where this one does
        target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
    lib = tvm.compile(tvm.IRModule({"main": dot}), target=target)
    assert "vdpbf16ps" in lib.mod.inspect_source("asm")
    if not has_bf16_dot(make_target("llvm")):
        pytest.skip("this CPU has no AVX512-BF16: the kernel was built, not run")
    x = np.arange(32, dtype=np.float32) / 8
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # exact: multiples of 1/8 below 4 are bf16 values
    c = tvm.runtime.tensor(np.ones(16, np.float32))
    lib["main"](tvm.runtime.tensor(bits), tvm.runtime.tensor(bits), c)
    np.testing.assert_allclose(c.numpy(), 1 + x[0::2] ** 2 + x[1::2] ** 2)
