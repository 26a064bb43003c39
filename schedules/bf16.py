"""The bf16 contraction's schedule on CPUs with AVX512-BF16: a register-tiled micro-kernel on vdpbf16ps.

One vdpbf16ps multiplies 16 pairs of bf16 values and adds each pair's sum to one of 16 fp32 accumulators: the
packed weight tile [16, 2] (tvmdm.precision's layout) against one pair of the activation row, broadcast. The
micro-kernel keeps ROWS x (16 * VECTORS) accumulators in registers over a block of K, and the tiles run in
parallel over the cores. Epilogues fused after the contraction (bias, GELU, residual) are computed per tile
from the accumulators, in fp32.

The instruction is reached through schedules.dpbf16ps, a function in LLVM IR linked into the module (the
``pragma_import_llvm`` annotation) and inlined by LLVM: TVM 0.27 cannot emit it directly (see schedules.dpbf16ps). The TIR
keeps the bf16 bits in uint16 / int32 vectors; the loop body becomes one vdpbf16ps.
"""
from __future__ import annotations

import warnings

import tvm
from tvm import tirx
from tvm.s_tir import Schedule, TensorIntrin
from tvm.s_tir.analysis import estimate_tir_flops
from tvm.script import tirx as T

from schedules.rule import FLOPS_ATTR, ScheduleRule
from schedules.rows import has_partials, place_partials
from schedules.packed import epilogue_into_tile, schedule_pair_pack, schedule_tiled_transpose
from schedules.default import inline_elementwise
from schedules.dpbf16ps import DPBF16PS_FUNCTION, DPBF16PS_LLVM
from tvmdm.core.target import cpu_has
from tvmdm.transform.stats_into_producers import GROUP_ROWS
from tvmdm.transform.kernels import BF16, GEMM_BLOCK, LANES, PAIR, TRANSPOSED_BLOCK, bf16_value
from tvmdm.transform.ir import has_block

INTRIN = "tvmdm_dot_16x2_bf16"
CPU_FEATURE = "avx512bf16"  # LLVM's name; /proc/cpuinfo says avx512_bf16
K_BLOCK = 256  # accumulate over this much of K before moving on (the tile's operands stay in L1/L2)


def register_dot_intrin(name: str, a_dtype: str, w_dtype: str, acc_dtype: str, lanes: int, group: int, value,
                        product) -> str:
    """Register the tensor intrinsic ``name`` of one dot-product instruction: ``lanes`` accumulators of
    ``acc_dtype`` each add ``group`` products of one activation row's ``group`` values (``a_dtype``, broadcast)
    by a packed weight tile [lanes, group] of ``w_dtype``, each element read as ``value(element)``; the
    instruction is ``product(a, w, c)``, the new accumulator vector."""

    @T.prim_func(s_tir=True)
    def desc(a: T.Buffer((group,), a_dtype, offset_factor=1), w: T.Buffer((lanes, group), w_dtype, offset_factor=1),
             c: T.Buffer((lanes,), acc_dtype, offset_factor=1, scope="local")):
        with T.sblock("root"):
            T.reads(c[0:lanes], a[0:group], w[0:lanes, 0:group])
            T.writes(c[0:lanes])
            for i, k in T.grid(lanes, group):
                with T.sblock("update"):
                    vi, vk = T.axis.remap("SR", [i, k])
                    c[vi] = c[vi] + value(a[vk]) * value(w[vi, vk])

    @T.prim_func(s_tir=True)
    def impl(a: T.Buffer((group,), a_dtype, offset_factor=1), w: T.Buffer((lanes, group), w_dtype, offset_factor=1),
             c: T.Buffer((lanes,), acc_dtype, offset_factor=1, scope="local")):
        with T.sblock("root"):
            T.reads(c[0:lanes], a[0:group], w[0:lanes, 0:group])
            T.writes(c[0:lanes])
            c[T.ramp(T.int32(0), 1, lanes)] = product(a, w, c)

    TensorIntrin.register(name, desc, impl, override=True)
    return name


register_dot_intrin(INTRIN, "uint16", "uint16", "float32", LANES, PAIR, bf16_value, lambda a, w, c: T.call_pure_extern(
    "float32x16", DPBF16PS_FUNCTION, c.vload([0], "float32x16"),
    T.broadcast(T.reinterpret(a.vload([0], "uint16x2"), dtype="int32"), LANES),
    T.reinterpret(w.vload([0, 0], "uint16x32"), dtype="int32x16")))


def has_bf16_dot(target: tvm.target.Target) -> bool:
    """Whether ``target``'s CPU (its mcpu, as LLVM knows it) has the AVX512-BF16 dot product."""
    return cpu_has(target, CPU_FEATURE)


def _divisor(n: int, choices) -> int:
    return next(c for c in choices if n % c == 0)


def schedule_bf16_gemm(func: tirx.PrimFunc, rows: int | None = None, vectors: int | None = None) -> tirx.PrimFunc:
    """The micro-kernel schedule for a kernel holding a ``bf16_gemm`` block (and fused epilogues).
    ``rows`` x ``vectors`` x 16 accumulators per tile (default: 4 x 4, or what divides the shape)."""
    return schedule_dot_gemm(func, GEMM_BLOCK, INTRIN, DPBF16PS_LLVM, PAIR, K_BLOCK, rows, vectors)


def schedule_dot_gemm(func: tirx.PrimFunc, block: str, intrin: str, llvm_ir: str | None, group: int, k_block: int,
                      rows: int | None = None, vectors: int | None = None, lanes: int = LANES) -> tirx.PrimFunc:
    """The register-tiled micro-kernel on a dot-product instruction (the tensor intrinsic ``intrin``: ``lanes``
    accumulators += ``group`` values of one activation row, broadcast, times a packed [lanes, group] weight
    tile; its LLVM function ``llvm_ir``, if any, linked in) for the kernel's contraction block ``block`` over
    packed weights. ``rows`` x ``vectors`` x ``lanes`` accumulators per tile (default: 4 x 4, or what divides the shape);
    K in blocks of ``k_block``. Symbolic rows come in whole tiles (tvmdm.transform.kernels.row_tiles)."""
    sch = Schedule(func)
    # The element-wise blocks between the contraction and the outputs (bias add, GELU's pieces) are inlined
    # into their readers: one epilogue expression per output.
    inline_elementwise(sch, sch.get_sblock("root"))
    gemm = sch.get_sblock(block)
    # Tiles of `rows` consecutive rows of the last leading axis (fusing the leading axes first would give
    # bindings that tensorize cannot blockize).
    *outer, m, n, k = sch.get_loops(gemm)
    static_rows = isinstance(sch.get(m).extent, tirx.IntImm)
    n_extent, k_extent = (int(sch.get(x).extent) for x in (n, k))
    # symbolic rows: row_tiles padded them to whole tiles of ROW_PAD, which 4 divides
    rows = rows or (_divisor(int(sch.get(m).extent), (4, 8, 6, 2, 1)) if static_rows else 4)
    vectors = vectors or _divisor(n_extent // lanes, (4, 3, 2, 1))
    k_block = k_block if k_extent % k_block == 0 else k_extent
    m_extent = int(sch.get(m).extent) if static_rows else None
    mo, mi = sch.split(m, [None, rows])
    no, nv, ni = sch.split(n, [None, vectors, lanes])
    ko, kp, ki = sch.split(k, [None, k_block // group, group])
    # A task of GROUP_ROWS rows, tile by tile, where a quantized model's next quantization statistics need whole
    # groups of rows, and on 512-bit registers (the Zen 4 kind's code on 2 Sapphire Rapids cores, alternating
    # runs: base layer int8 (8, 128) 0.955x the time of a task a tile, (1, 128) 0.970x, bf16 0.978x and 0.990x;
    # the AVX2 kind's int8 1.016x, so not there). Not yet measured on a Zen 4.
    grouped = static_rows and (has_partials(sch) or lanes == LANES) and m_extent % GROUP_ROWS == 0 \
        and GROUP_ROWS % rows == 0
    groups = sch.split(mo, [None, GROUP_ROWS // rows]) if grouped else [mo]
    sch.reorder(no, *outer, *groups, ko, kp, mi, nv, ni, ki)
    task = sch.fuse(no, *outer, groups[0])
    tile = groups[-1] if grouped else task
    sch.parallel(task)
    if static_rows:
        acc = sch.cache_write(gemm, 0, "local")
        sch.reverse_compute_at(acc, tile)
    else:  # the whole tiles are already an intermediate, copied out per tile (guarded)
        acc = gemm
        sch.set_scope(gemm, 0, "local")
    init = sch.decompose_reduction(gemm, ko)
    # before tensorize, which replaces the contraction's block (the accumulators' block for symbolic rows)
    epilogue_into_tile(sch, acc, tile, lanes)
    sch.unroll(mi)
    sch.unroll(nv)
    sch.tensorize(ni, intrin)
    if llvm_ir is not None:
        sch.annotate(task, "pragma_import_llvm", llvm_ir)
    sch.vectorize(sch.get_loops(init)[-1])
    place_partials(sch, task, covers=grouped)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


TRANSPOSE_TILE = 8  # rows x rows tiles of the transposing conversion (8: 1.8 ms vs 6.1 default on [1024, 3072])


def schedule_transposed_conversion(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """x^T as bf16 bits (a weight gradient's left operand), in square tiles: each tile's reads and writes stay
    in L1 (the default schedule streams one column at a time, reading a cache line per element)."""
    return schedule_tiled_transpose(func, TRANSPOSED_BLOCK, TRANSPOSE_TILE)


class Bf16Contractions(ScheduleRule):
    """precision="bf16" on a CPU: every kernel with a bf16 contraction block on the vdpbf16ps micro-kernel, the
    transposing conversions of weight gradients in tiles, and the packings of weights and dY. On a CPU without
    AVX512-BF16 nothing is taken:
    the default schedule computes the same numbers in fp32 FMAs (bf16 values are exact in fp32), slower (one
    warning says so)."""

    name = "bf16 contractions"

    def apply(self, kernels: dict, options) -> dict:
        if not (options.on_cpu and options.precision == "bf16"):
            return {}
        if not has_bf16_dot(options.target):
            if any(has_block(f, GEMM_BLOCK) for f in kernels.values()):
                warnings.warn(f"target {options.target} has no AVX512-BF16 dot product: the bf16 contractions run "
                              "on a generic fp32 schedule (same results, slower)", stacklevel=2)
            return {}
        return super().apply(kernels, options)

    def schedule(self, func, options):
        if has_block(func, TRANSPOSED_BLOCK):
            return schedule_transposed_conversion(func)
        if has_block(func, BF16.pack_name):
            return schedule_pair_pack(func, BF16.pack_name)
        if not has_block(func, GEMM_BLOCK):
            return None
        flops = int(estimate_tir_flops(tvm.IRModule({"main": func})))
        return schedule_bf16_gemm(func).with_attr(FLOPS_ATTR, flops)
