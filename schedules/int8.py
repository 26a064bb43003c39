"""The int8 contraction's schedule on CPUs: the register-tiled micro-kernel on the integer dot product.

One vpdpbusd (AVX512-VNNI) multiplies 4 consecutive uint8 activations of a row (broadcast) by a packed int8
weight tile [16, 4] (tvmdm.transform.int8_kernels' layout: 64 bytes, contiguous) and adds each lane's 4 products
to one of 16 int32 accumulators: 64 multiply-adds per instruction, 4x vdpbf16ps's. The tiles are those of the
bf16 micro-kernel (schedules.bf16.schedule_dot_gemm); the zero point's term, the dequantize (scale) and the
fused bias / GELU / residual epilogues are computed per tile from the accumulators.

The instruction is reached as vdpbf16ps is: an LLVM function linked into the module and inlined (TVM 0.27's
call_llvm_pure_intrin does not bitcast to the <64 x i8> operands LLVM 22's intrinsic takes). On a CPU without
AVX512-VNNI the same kernel gets a vectorized int32 schedule (widened products; same results, slower) and one
warning says so.
"""
from __future__ import annotations

import warnings

import tvm
from tvm import tirx
from tvm.s_tir import Schedule, TensorIntrin
from tvm.s_tir.analysis import estimate_tir_flops
from tvm.script import tirx as T

from schedules.bf16 import schedule_dot_gemm
from schedules.default import inline_elementwise, tile_dividing
from schedules.packed import epilogue_into_tile, has_block
from schedules.rule import FLOPS_ATTR, ScheduleRule
from tvmdm.core.target import vector_lanes
from tvmdm.transform.int8_kernels import INT8_GEMM_BLOCK, INT8_LANES as LANES, QUAD

INTRIN = "tvmdm_dot_16x4_u8s8"
CPU_FEATURE = "avx512vnni"  # LLVM's name; /proc/cpuinfo says avx512_vnni
K_BLOCK = 512  # accumulate over this much of K before moving on (as the bf16 kernel's 256: the same bytes)
DPBUSD_FUNCTION = "tvmdm_dpbusd"
DPBUSD_LLVM = r"""
define internal <16 x i32> @tvmdm_dpbusd(<16 x i32> %acc, <16 x i32> %a, <16 x i32> %b) #0 {
  %ab = bitcast <16 x i32> %a to <64 x i8>
  %bb = bitcast <16 x i32> %b to <64 x i8>
  %r = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> %acc, <64 x i8> %ab, <64 x i8> %bb)
  ret <16 x i32> %r
}
declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <64 x i8>, <64 x i8>)
attributes #0 = { alwaysinline nounwind "target-features"="+avx512f,+avx512vnni" }
"""


@T.prim_func(s_tir=True)
def _dot_desc(a: T.Buffer((QUAD,), "uint8", offset_factor=1), w: T.Buffer((LANES, QUAD), "int8", offset_factor=1),
              c: T.Buffer((LANES,), "int32", offset_factor=1, scope="local")):
    with T.sblock("root"):
        T.reads(c[0:LANES], a[0:QUAD], w[0:LANES, 0:QUAD])
        T.writes(c[0:LANES])
        for i, k in T.grid(LANES, QUAD):
            with T.sblock("update"):
                vi, vk = T.axis.remap("SR", [i, k])
                c[vi] = c[vi] + T.Cast("int32", a[vk]) * T.Cast("int32", w[vi, vk])


@T.prim_func(s_tir=True)
def _dot_impl(a: T.Buffer((QUAD,), "uint8", offset_factor=1), w: T.Buffer((LANES, QUAD), "int8", offset_factor=1),
              c: T.Buffer((LANES,), "int32", offset_factor=1, scope="local")):
    with T.sblock("root"):
        T.reads(c[0:LANES], a[0:QUAD], w[0:LANES, 0:QUAD])
        T.writes(c[0:LANES])
        quad = T.reinterpret(a.vload([0], "uint8x4"), dtype="int32")
        c[T.ramp(T.int32(0), 1, LANES)] = T.call_pure_extern(
            "int32x16", DPBUSD_FUNCTION, c.vload([0], "int32x16"), T.broadcast(quad, LANES),
            T.reinterpret(w.vload([0, 0], "int8x64"), dtype="int32x16"))


TensorIntrin.register(INTRIN, _dot_desc, _dot_impl, override=True)


def has_int8_dot(target: tvm.target.Target) -> bool:
    """Whether ``target``'s CPU (its mcpu and mattr, as LLVM knows them) has AVX512-VNNI's vpdpbusd."""
    from tvm.target import codegen

    return target.kind.name == "llvm" and bool(codegen.target_has_features(CPU_FEATURE, target))


def schedule_int8_gemm(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """vpdpbusd's micro-kernel (schedules.bf16.schedule_dot_gemm with the u8 x s8 quad intrinsic)."""
    return schedule_dot_gemm(func, INT8_GEMM_BLOCK, INTRIN, DPBUSD_LLVM, QUAD, K_BLOCK)


def schedule_int8_gemm_widened(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc:
    """Without vpdpbusd: tiles of rows x 2 vectors of ``lanes`` int32 accumulators, each product widened to
    int32 (LLVM's vpmulld / vpaddd), a quad of k unrolled; the tiles in parallel."""
    sch = Schedule(func)
    inline_elementwise(sch, sch.get_sblock("root"))
    gemm = sch.get_sblock(INT8_GEMM_BLOCK)
    *outer, m, n, k = sch.get_loops(gemm)
    static_rows = isinstance(sch.get(m).extent, tirx.IntImm)
    mo, mi = sch.split(m, [None, tile_dividing(sch.get(m).extent, (4, 2, 1)) if static_rows else 4])
    no, nv, ni = sch.split(n, [None, LANES // lanes, lanes])
    ko, ki = sch.split(k, [None, QUAD])
    sch.reorder(no, *outer, mo, ko, mi, ki, nv, ni)
    tile = sch.fuse(no, *outer, mo)
    sch.parallel(tile)
    if static_rows:
        acc = sch.cache_write(gemm, 0, "local")
        sch.reverse_compute_at(acc, tile)
    else:
        acc = gemm
        sch.set_scope(gemm, 0, "local")
    sch.unroll(mi)
    sch.unroll(ki)
    sch.unroll(nv)
    sch.vectorize(ni)
    init = sch.decompose_reduction(gemm, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    epilogue_into_tile(sch, acc, tile, lanes)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


class Int8Contractions(ScheduleRule):
    """Every kernel with an int8_gemm block (a quantized model's contractions, made by tvmdm.transform.
    quantized), on the vpdpbusd micro-kernel where the CPU has AVX512-VNNI, else widened to int32 vectors
    (one warning says so)."""

    name = "int8 contractions"

    def apply(self, kernels: dict, options) -> dict:
        if not options.on_cpu or not any(has_block(f, INT8_GEMM_BLOCK) for f in kernels.values()):
            return {}
        if not has_int8_dot(options.target):
            warnings.warn(f"target {options.target} has no AVX512-VNNI integer dot product: the int8 contractions "
                          "run on widened int32 vectors (same results, slower)", stacklevel=2)
        return super().apply(kernels, options)

    def schedule(self, func, options):
        if not has_block(func, INT8_GEMM_BLOCK):
            return None
        flops = int(estimate_tir_flops(tvm.IRModule({"main": func})))
        if has_int8_dot(options.target):
            return schedule_int8_gemm(func).with_attr(FLOPS_ATTR, flops)
        return schedule_int8_gemm_widened(func, vector_lanes(options.target)).with_attr(FLOPS_ATTR, flops)
