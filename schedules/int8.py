"""The int8 contraction's schedule on CPUs: the register-tiled micro-kernel on the integer dot product.

One vpdpbusd (AVX512-VNNI) multiplies 4 consecutive uint8 activations of a row (broadcast) by a packed int8
weight tile [16, 4] (tvmdm.transform.int8_kernels' layout: 64 bytes, contiguous) and adds each lane's 4 products
to one of 16 int32 accumulators: 64 multiply-adds per instruction, 4x vdpbf16ps's. The tiles are those of the
bf16 micro-kernel (schedules.bf16.schedule_dot_gemm); the zero point's term, the dequantize (scale) and the
fused bias / GELU / residual epilogues are computed per tile from the accumulators.

The instruction is reached as vdpbf16ps is: an LLVM function linked into the module and inlined (TVM 0.27's
call_llvm_pure_intrin does not bitcast to the <64 x i8> operands LLVM 22's intrinsic takes).

On a CPU without AVX512-VNNI (Zen 4 with AVX-512 hidden: AVX2 only) the weights are packed as int16 pairs and
each vpmaddwd adds 2 exact products to each of 8 lanes (vpmaddubsw would take 4 u8 x s8 products but saturates
their pair sums to int16); one warning says so. 2 Zen 4 cores, base layer's FFN contractions at (8, 128):
vpdpbusd 680-900 GOP/s, vpmaddwd 210-236, widened int32 multiplies 65.
"""
from __future__ import annotations

import warnings

import tvm
from tvm import tirx
from tvm.s_tir import Schedule
from tvm.s_tir.analysis import estimate_tir_flops
from tvm.script import tirx as T

from schedules import amx
from schedules.amx import has_amx_int8
from schedules.bf16 import register_dot_intrin, schedule_dot_gemm
from schedules.dpbf16ps import llvm_dot_function
from schedules.packed import has_block
from schedules.rule import DOES_NOT_FIT, FLOPS_ATTR, ScheduleRule
from tvmdm.core.target import has_int8_dot
from tvmdm.transform.int8_kernels import INT8_GEMM_BLOCK, VNNI, WIDE

INTRIN = "tvmdm_dot_16x4_u8s8"
K_BLOCK = 512  # accumulate over this much of K before moving on (as the bf16 kernel's 256: the same bytes)
DPBUSD_FUNCTION = "tvmdm_dpbusd"
DPBUSD_LLVM = llvm_dot_function(DPBUSD_FUNCTION, "llvm.x86.avx512.vpdpbusd.512", "<16 x i32>", "<64 x i8>",
                                "+avx512f,+avx512vnni")


def _widened(v):
    return T.Cast("int32", v)


register_dot_intrin(INTRIN, "uint8", "int8", "int32", VNNI.lanes, VNNI.group, _widened, lambda a, w, c: T.call_pure_extern(
    "int32x16", DPBUSD_FUNCTION, c.vload([0], "int32x16"),
    T.broadcast(T.reinterpret(a.vload([0], "uint8x4"), dtype="int32"), VNNI.lanes),
    T.reinterpret(w.vload([0, 0], "int8x64"), dtype="int32x16")))

WIDE_INTRIN = "tvmdm_dot_8x2_u8s16"


register_dot_intrin(WIDE_INTRIN, "uint8", "int16", "int32", WIDE.lanes, WIDE.group, _widened, lambda a, w, c: (
    c.vload([0], "int32x8") + T.call_llvm_pure_intrin(
        "int32x8", "llvm.x86.avx2.pmadd.wd",
        T.reinterpret(T.broadcast(T.reinterpret(T.Cast("int16x2", a.vload([0], "uint8x2")), dtype="int32"),
                                  WIDE.lanes), dtype="int16x16"),
        w.vload([0, 0], "int16x16"))))


def schedule_int8_gemm(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """vpdpbusd's micro-kernel (schedules.bf16.schedule_dot_gemm with the u8 x s8 quad intrinsic)."""
    return schedule_dot_gemm(func, INT8_GEMM_BLOCK, INTRIN, DPBUSD_LLVM, VNNI.group, K_BLOCK)


def schedule_int8_gemm_widened(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """vpmaddwd's micro-kernel for weights packed as int16 pairs (WIDE): 4 rows x 3 vectors of 8 int32
    accumulators (12 of AVX2's 16 registers), a pair of u8 activations widened to int16 and broadcast."""
    sch = Schedule(func)
    n = int(sch.get(sch.get_loops(sch.get_sblock(INT8_GEMM_BLOCK))[-2]).extent)
    vectors = next(v for v in (3, 2, 1) if n // WIDE.lanes % v == 0)
    return schedule_dot_gemm(func, INT8_GEMM_BLOCK, WIDE_INTRIN, None, WIDE.group, K_BLOCK, vectors=vectors,
                             lanes=WIDE.lanes)


def _packing_of(func: tirx.PrimFunc):
    """The weight packing an int8_gemm kernel reads (int16 weights: WIDE), None without such a block."""
    sch = Schedule(func)
    try:
        block = sch.get(sch.get_sblock(INT8_GEMM_BLOCK))
    except DOES_NOT_FIT:  # get_sblock raises when there is no such block
        return None
    return WIDE if any(r.source.dtype == WIDE.dtype for r in block.reads) else VNNI  # (0.27: regions' .source)


class Int8Contractions(ScheduleRule):
    """Every kernel with an int8_gemm block (a quantized model's contractions, made by tvmdm.transform.
    quantized) on the tile units where the CPU has AMX-INT8 and the shape fills whole tiles (schedules.amx),
    else on vpdpbusd where it has AVX512-VNNI, else on vpmaddwd with int16 pairs (one warning says so)."""

    name = "int8 contractions"

    def apply(self, kernels: dict, options) -> dict:
        if not options.on_cpu or not any(has_block(f, INT8_GEMM_BLOCK) for f in kernels.values()):
            return {}
        if not has_int8_dot(options.target):
            warnings.warn(f"target {options.target} has no AVX512-VNNI integer dot product: the int8 contractions "
                          "run on vpmaddwd (int16 pairs; same results, about 3x slower)", stacklevel=2)
        return super().apply(kernels, options)

    def schedule(self, func, options):
        packing = _packing_of(func)
        if packing is None:
            return None
        flops = int(estimate_tir_flops(tvm.IRModule({"main": func})))
        scheduled = None
        if packing is VNNI and (has_amx_int8(options.target) or amx.EMULATE):  # whole tiles: on AMX-INT8
            scheduled = amx.schedule_amx_gemm(func, emulate=amx.EMULATE, op=amx.INT8_TILES)
        if scheduled is None:
            scheduled = schedule_int8_gemm(func) if packing is VNNI else schedule_int8_gemm_widened(func)
        return scheduled.with_attr(FLOPS_ATTR, flops)
