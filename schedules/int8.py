"""The int8 contraction's schedule on CPUs: the register-tiled micro-kernel on the integer dot product.

One vpdpbusd (AVX512-VNNI) multiplies 4 consecutive uint8 activations of a row (broadcast) by a packed int8
weight tile [16, 4] (tvmdm.transform.int8_kernels' layout: 64 bytes, contiguous) and adds each lane's 4 products
to one of 16 int32 accumulators: 64 multiply-adds per instruction, 4x vdpbf16ps's. The tiles are those of the
bf16 micro-kernel (schedules.bf16.schedule_dot_gemm); the zero point's term, the dequantize (scale) and the
fused bias / GELU / residual epilogues are computed per tile from the accumulators.

The instruction is reached as vdpbf16ps is: an LLVM function linked into the module and inlined (TVM 0.27's
call_llvm_pure_intrin does not bitcast to the <64 x i8> operands LLVM 22's intrinsic takes).

On a CPU without AVX512-VNNI (Zen 4 with AVX-512 hidden: AVX2 only) the fast byte product is vpmaddubsw: 32
u8 x s8 products added in pairs into int16 lanes, which saturate, then a vpmaddwd by ones into 8 int32 lanes
(onnxruntime's AVX2 kernels, saturation included). Here K's rows come in an order whose pairs cannot saturate
(tvmdm.transform.saturation_free), so its results are exact; weights with no such order are packed as int16
pairs for vpmaddwd (2 exact products per lane, int16 activations). One warning says the CPU has no VNNI.
A CPU with AVX-VNNI but no AVX-512 (Alder Lake and later client parts) runs vpdpbusd on 256-bit registers over
the same [N/8, K/4, 8, 4] packing, in the weights' own order (no saturation to avoid).
2 Zen 4 cores, [1024, 768] x [768, 3072]: vpdpbusd 680-900 GOP/s (AVX-512), vpmaddubsw 319, vpmaddwd 201,
widened int32 multiplies 65.
"""
from __future__ import annotations

import warnings

import tvm
from tvm import tirx
from tvm.s_tir import Schedule
from tvm.s_tir.analysis import estimate_tir_flops
from tvm.script import tirx as T

from schedules import amx
from schedules.bf16 import register_dot_intrin, schedule_dot_gemm
from schedules.default import inline_elementwise, tile_dividing
from schedules.dpbf16ps import llvm_dot_function
from schedules.rule import DOES_NOT_FIT, FLOPS_ATTR, ScheduleRule
from tvmdm.core.target import has_amx_int8, has_avx_vnni, has_int8_dot
from tvmdm.transform.int8_kernels import BYTE_PAIRS, INT8_GEMM_BLOCK, REORDER_BLOCK, VNNI, WIDE
from tvmdm.transform.ir import has_block

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


register_dot_intrin(WIDE_INTRIN, WIDE.activations, WIDE.dtype, "int32", WIDE.lanes, WIDE.group, _widened,
                    lambda a, w, c: c.vload([0], "int32x8") + T.call_llvm_pure_intrin(
                        "int32x8", "llvm.x86.avx2.pmadd.wd",
                        T.reinterpret(T.broadcast(T.reinterpret(a.vload([0], "int16x2"), dtype="int32"), WIDE.lanes),
                                      dtype="int16x16"),
                        w.vload([0, 0], "int16x16")))


BYTE_PAIRS_INTRIN = "tvmdm_dot_8x4_u8s8_pairs"

# exact only because K's order keeps every pair sum within int16 (tvmdm.transform.saturation_free)
register_dot_intrin(BYTE_PAIRS_INTRIN, BYTE_PAIRS.activations, BYTE_PAIRS.dtype, "int32", BYTE_PAIRS.lanes,
                    BYTE_PAIRS.group, _widened, lambda a, w, c: c.vload([0], "int32x8") + T.call_llvm_pure_intrin(
                        "int32x8", "llvm.x86.avx2.pmadd.wd",
                        T.call_llvm_pure_intrin(
                            "int16x16", "llvm.x86.avx2.pmadd.ub.sw",
                            T.reinterpret(T.broadcast(T.reinterpret(a.vload([0], "uint8x4"), dtype="int32"),
                                                      BYTE_PAIRS.lanes), dtype="uint8x32"),
                            w.vload([0, 0], "int8x32")),
                        T.broadcast(T.int16(1), 16)))


AVX_VNNI_INTRIN = "tvmdm_dot_8x4_u8s8"

# AVX-VNNI: vpdpbusd on 256-bit registers (the VEX form; LLVM's intrinsic is the one AVX512VL-VNNI shares) over
# BYTE_PAIRS' [8, 4] tiles in the stored order: four products added into int32, nothing to saturate
register_dot_intrin(AVX_VNNI_INTRIN, BYTE_PAIRS.activations, BYTE_PAIRS.dtype, "int32", BYTE_PAIRS.lanes,
                    BYTE_PAIRS.group, _widened, lambda a, w, c: T.call_llvm_pure_intrin(
                        "int32x8", "llvm.x86.avx512.vpdpbusd.256", c.vload([0], "int32x8"),
                        T.reinterpret(T.broadcast(T.reinterpret(a.vload([0], "uint8x4"), dtype="int32"),
                                                  BYTE_PAIRS.lanes), dtype="uint8x32"),
                        w.vload([0, 0], "int8x32")))


def schedule_int8_gemm(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """vpdpbusd's micro-kernel (schedules.bf16.schedule_dot_gemm with the u8 x s8 quad intrinsic)."""
    return schedule_dot_gemm(func, INT8_GEMM_BLOCK, INTRIN, DPBUSD_LLVM, VNNI.group, K_BLOCK)


def schedule_int8_gemm_widened(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """vpmaddwd's micro-kernel for weights packed as int16 pairs (WIDE) and int16 activations: 8 rows x 1 vector
    of 8 int32 accumulators (4 x 3 spills: vpmaddwd has no accumulating form, each product needs a register;
    2 Zen 4 cores, [1024, 768] x [768, 3072]: 8 x 1 201 GOP/s, 4 x 2 175)."""
    return schedule_dot_gemm(func, INT8_GEMM_BLOCK, WIDE_INTRIN, None, WIDE.group, K_BLOCK, rows=_rows(func, 8),
                             vectors=1, lanes=WIDE.lanes)


def schedule_int8_gemm_byte_pairs(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """vpmaddubsw's micro-kernel (BYTE_PAIRS, K in a saturation-free order): 4 rows x 2 vectors of 8 int32
    accumulators, 4 u8 activations broadcast per row (2 Zen 4 cores, [1024, 768] x [768, 3072]: 4 x 2 319
    GOP/s, 8 x 1 248, 4 x 3 308; onnxruntime's saturating kernel 317 with its quantization)."""
    return _byte_pairs_kernel(func, BYTE_PAIRS_INTRIN, vectors=(2, 1))


def schedule_int8_gemm_avx_vnni(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """AVX-VNNI's micro-kernel (BYTE_PAIRS in the stored order, vpdpbusd on ymm): 4 rows x 3 vectors of 8 int32
    accumulators where N allows (vpdpbusd accumulates in place: 12 accumulators, 3 weight vectors and the
    broadcast fill the 16 registers), else 4 x 2. Not yet measured: no AVX-VNNI machine among ours."""
    return _byte_pairs_kernel(func, AVX_VNNI_INTRIN, vectors=(3, 2, 1))


def _byte_pairs_kernel(func: tirx.PrimFunc, intrin: str, vectors) -> tirx.PrimFunc:
    """schedule_dot_gemm over BYTE_PAIRS' [8, 4] tiles with ``intrin``: 4 rows (or fewer, see _rows) x the
    first of ``vectors`` (largest first) that divides N's vectors."""
    sch = Schedule(func)
    n = int(sch.get(sch.get_loops(sch.get_sblock(INT8_GEMM_BLOCK))[-2]).extent)
    return schedule_dot_gemm(func, INT8_GEMM_BLOCK, intrin, None, BYTE_PAIRS.group, K_BLOCK, rows=_rows(func, 4),
                             vectors=tile_dividing(n // BYTE_PAIRS.lanes, list(vectors)), lanes=BYTE_PAIRS.lanes)


def schedule_reorder(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The activations' K order (tvmdm.transform.int8_kernels.reorder_func) with the quantization producing
    them inlined: rows in parallel, each row's gather from its own values (in L1), unrolled by 8."""
    sch = Schedule(func)
    inline_elementwise(sch, sch.get_sblock("root"))
    *lead, k = sch.get_loops(sch.get_sblock(REORDER_BLOCK))
    sch.parallel(sch.fuse(*lead))
    sch.unroll(sch.split(k, [None, 8])[1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _rows(func: tirx.PrimFunc, most: int) -> int:
    """``most`` rows a tile where they divide the rows (symbolic rows come padded to whole tiles of ROW_PAD,
    which 8 divides), else the largest power of two below that does."""
    sch = Schedule(func)
    extent = sch.get(sch.get_loops(sch.get_sblock(INT8_GEMM_BLOCK))[-3]).extent
    if not isinstance(extent, tirx.IntImm):
        return most
    return tile_dividing(extent, [r for r in (most, most // 2, most // 4) if r] + [1])


def _packing_of(func: tirx.PrimFunc):
    """The weight packing an int8_gemm kernel reads (by its packed weight's dtype and lanes), None without
    such a block."""
    sch = Schedule(func)
    try:
        block = sch.get(sch.get_sblock(INT8_GEMM_BLOCK))
    except DOES_NOT_FIT:  # get_sblock raises when there is no such block
        return None
    weight = next(r.source for r in block.reads if len(r.source.shape) == 4)  # (0.27: regions' .source)
    lanes = int(weight.shape[2])
    return next(p for p in (VNNI, BYTE_PAIRS, WIDE) if p.dtype == weight.dtype and p.lanes == lanes)


class Int8Contractions(ScheduleRule):
    """Every kernel with an int8_gemm block (a quantized model's contractions, made by tvmdm.transform.
    quantized) on the tile units where the CPU has AMX-INT8 and the shape fills whole tiles (schedules.amx),
    else on vpdpbusd where it has AVX512-VNNI (zmm) or AVX-VNNI (ymm), else on vpmaddubsw or vpmaddwd (one
    warning says so)."""

    name = "int8 contractions"

    def apply(self, kernels: dict, options) -> dict:
        if not options.on_cpu or not any(has_block(f, INT8_GEMM_BLOCK) for f in kernels.values()):
            return {}
        if not has_int8_dot(options.target) and not has_avx_vnni(options.target):
            warnings.warn(f"target {options.target} has no VNNI integer dot product: the int8 contractions "
                          "run on vpmaddubsw (K reordered so that it cannot saturate: same results, about 2x "
                          "slower), or vpmaddwd where no such order exists (int16 pairs, about 3x slower)",
                          stacklevel=2)
        return super().apply(kernels, options)

    def schedule(self, func, options):
        if has_block(func, REORDER_BLOCK):
            return schedule_reorder(func)
        packing = _packing_of(func)
        if packing is None:
            return None
        flops = int(estimate_tir_flops(tvm.IRModule({"main": func})))
        scheduled = None
        if packing is VNNI and (has_amx_int8(options.target) or amx.EMULATE):  # whole tiles: on AMX-INT8
            scheduled = amx.schedule_amx_gemm(func, emulate=amx.EMULATE, op=amx.INT8_TILES)
        if scheduled is None and packing is BYTE_PAIRS and has_avx_vnni(options.target):
            scheduled = schedule_int8_gemm_avx_vnni(func)  # exact in any K order
        if scheduled is None:
            scheduled = {VNNI: schedule_int8_gemm, BYTE_PAIRS: schedule_int8_gemm_byte_pairs,
                         WIDE: schedule_int8_gemm_widened}[packing](func)
        return scheduled.with_attr(FLOPS_ATTR, flops)
