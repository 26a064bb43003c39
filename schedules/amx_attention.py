"""The attention on the AMX tile units, scores to context in one kernel (bf16 inference).

tvmdm.transform.tile_attention replaces each SM / context pair of a bf16 module for a CPU with AMX by one
``tile_attention`` kernel over operands it prepares (keys padded to whole blocks of 32, ``KEY_BLOCK``):

  q     [B, H, L, D] bf16 bits: the queries, row-major (A tiles: 16 rows x 32 d);
  k     [B, H, L/16, D/2, 16, 2]: the keys packed as B tiles of QK^T (16 keys x pairs of d, 1 KiB each);
  v     [B, H, D/16, L/2, 16] uint32: the values packed as B tiles of PV (16 d x pairs of keys, a pair's two
        bf16 in one uint32, its first key's low);
  mask  [B, 1, L] fp32, added to the scaled scores (padded keys: -inf); [B, L, L] with a row per query;
  out   [B, L, H, D] fp32 (the rows past the sequence are computed and cut by the caller).

Its reference semantics is ``attention_func`` (TE, any CPU); ``schedule_tile_attention`` replaces it with the
hand-written kernel: one unit of work per (batch, head), in parallel, its blocks of 32 queries in turn (a unit
per block of queries, each allocating its buffers and loading the tile configuration, took 1.03 against 0.84 ms
for BERT-base's heads at (8, 128) on 2 Sapphire Rapids cores). For each block it computes the
32 x L scores block by block of 32 keys (4 accumulator tiles from 2 query tiles and 2 key tiles, D in steps of
32) into a buffer of its own (32 x L fp32: 64 KiB at L = 512, in L2), the softmax of each row while it is in
L1 (max, exp, sum, then the probabilities as bf16 into a second buffer), and the 32 x D context from them and
the packed values, 32 columns at a time, stored straight into ``out``. The scores and probabilities never
leave the core: the paper's SM and context fused, as the static shapes' separate kernels cannot.

Preconditions: D a multiple of 32; L = ``blocks`` * 32 (a scalar parameter, so that every loop is whole).
"""
from __future__ import annotations

import functools
import math

from tvm import tirx
from tvm.s_tir import Schedule
from tvm.script import tirx as T

from schedules import amx
from schedules.amx import (AMX_ATTR, A_TILES, ACC, B_TILES, TILE_BYTES, TILE_ROWS, load_tile_config,
                           tile_instruction)
from schedules.default import inline_elementwise
from schedules.rule import ScheduleRule
from tvmdm.core.target import has_amx_bf16
from tvmdm.transform.kernels import bf16_bits, bf16_value
from tvmdm.transform.tile_attention import OPERANDS, TILE_ATTENTION_ATTR
from tvmdm.transform.ir import has_block

LANES = 16  # fp32 lanes of a zmm register: the softmax's vectors
LOG2E = 1.4426950408889634
EXP_FLOOR = -87.0  # exp's argument is clamped here: 2^n stays a normal float (exp(-87) ~ 1.6e-38)


def fast_exp(x):
    """exp(x) for x <= 0 (a softmax's shifted scores): 2^n * 2^f with n = floor(x log2 e), 2^f by its Taylor
    polynomial of degree 6 on [0, 1) (relative error < 2e-5, far below bf16's 4e-3)."""
    t = tirx.max(x, tirx.const(EXP_FLOOR, "float32")) * tirx.const(LOG2E, "float32")
    n = tirx.floor(t)
    f = (t - n) * tirx.const(math.log(2), "float32")  # 2^(t - n) = e^f
    poly = tirx.const(1.0 / math.factorial(6), "float32")
    for degree in range(5, -1, -1):
        poly = poly * f + tirx.const(1.0 / math.factorial(degree), "float32")
    scale = tirx.reinterpret("float32", (n.astype("int32") + 127) << 23)
    return poly * scale


@functools.lru_cache(maxsize=None)
def tile_attention_kernel(heads: int, head_dim: int, scale: float, per_query: bool = False,
                          emulate: bool = False) -> tirx.PrimFunc:
    """The hand-written kernel of ``attention_func(heads, head_dim, scale, per_query)`` (same parameters). ``emulate``:
    every tile instruction as the loops it stands for (what the tile units compute, on any CPU: tests)."""
    H, D = heads, head_dim
    d_steps, col_blocks = D // 32, D // 32
    per_row = int(per_query)  # 1: the mask has a row per query; 0: one row for all
    neg_inf = float("-inf")

    @T.macro
    def zero_accumulators(acc):
        for t in T.unroll(4):
            if emulate:
                for r, x in T.grid(TILE_ROWS, 16):
                    acc[t, r, x] = T.float32(0)
            else:
                T.evaluate(tile_instruction("tilezero", T.int8(ACC[0] + t)))

    @T.macro
    def tile_products(acc, a_tiles, b_tiles):  # accumulator t += A tile t // 2 times B tile t % 2
        for t in T.unroll(4):
            if emulate:
                for m, x, j, p in T.grid(TILE_ROWS, 16, 16, 2):
                    acc[t, m, x] = acc[t, m, x] + bf16_value(a_tiles[t // 2, m, j * 2 + p]) * \
                        bf16_value(b_tiles[t % 2, j, x * 2 + p])
            else:
                T.evaluate(tile_instruction("tdpbf16ps", T.int8(ACC[0] + t), T.int8(A_TILES[0] + t // 2),
                                            T.int8(B_TILES[0] + t % 2)))

    @T.prim_func(s_tir=True)
    def kernel(q_h: T.handle, k_h: T.handle, v_h: T.handle, m_h: T.handle, blocks: T.int64, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch = T.int64()
        q = T.match_buffer(q_h, (batch, H, blocks * 32, D), "uint16")
        k = T.match_buffer(k_h, (batch, H, blocks * 2, D // 2, 16, 2), "uint16")
        v = T.match_buffer(v_h, (batch, H, D // 16, blocks * 16, 16), "uint32")
        mask = T.match_buffer(m_h, (batch, blocks * 32 * per_row + 1 - per_row, blocks * 32), "float32")
        out = T.match_buffer(o_h, (batch, blocks * 32, H, D), "float32")
        with T.sblock("root"):
            qf = T.decl_buffer((batch * H * (blocks * 32) * D,), "uint16", data=q.data)
            kf = T.decl_buffer((batch * H * (blocks * 32) * D,), "uint16", data=k.data)
            vf = T.decl_buffer((batch * H * (blocks * 16) * D,), "uint32", data=v.data)
            of = T.decl_buffer((batch * (blocks * 32) * H * D,), "float32", data=out.data)
            for unit in T.parallel(batch * H):
                b = unit // H
                h = unit % H
                scores = T.decl_buffer((32 * (blocks * 32),), "float32", scope="global")
                probs = T.decl_buffer((32 * (blocks * 32),), "uint16", scope="global")
                acc = T.decl_buffer((4, TILE_ROWS, 16), "float32", scope="local")  # emulated tiles
                a_tiles = T.decl_buffer((2, TILE_ROWS, 32), "uint16", scope="local")
                b_tiles = T.decl_buffer((2, TILE_ROWS, 32), "uint16", scope="local")
                config = T.decl_buffer((8,), "uint64", scope="local")
                lanes = T.decl_buffer((LANES,), "float32", scope="local")
                row = T.decl_buffer((2,), "float32", scope="local")  # the row's max, then 1 / its sum
                if not emulate:
                    load_tile_config(config)
                head = b * H + h
                for qb in range(blocks):
                    # scores: 32 queries x 32 keys a block, D in steps of 32
                    for kb in range(blocks):
                        zero_accumulators(acc)
                        for step in range(d_steps):
                            for t in T.unroll(2):
                                a_at = (head * (blocks * 32) + qb * 32 + t * 16) * D + step * 32
                                b_at = ((head * blocks * 2 + kb * 2 + t) * (D // 2) + step * 16) * 32
                                if emulate:
                                    for r, x in T.grid(TILE_ROWS, 32):
                                        a_tiles[t, r, x] = qf[a_at + r * D + x]
                                        b_tiles[t, r, x] = kf[b_at + r * 32 + x]
                                else:
                                    T.evaluate(tile_instruction("tileloadd64", T.int8(A_TILES[0] + t),
                                                       T.address_of(qf[a_at]), T.int64(D * 2)))
                                    T.evaluate(tile_instruction("tileloadd64", T.int8(B_TILES[0] + t),
                                                       T.address_of(kf[b_at]), T.int64(TILE_BYTES)))
                            tile_products(acc, a_tiles, b_tiles)
                        for t in T.unroll(4):
                            s_at = t // 2 * 16 * (blocks * 32) + kb * 32 + t % 2 * 16
                            if emulate:
                                for r, x in T.grid(TILE_ROWS, 16):
                                    scores[s_at + r * (blocks * 32) + x] = acc[t, r, x]
                            else:
                                T.evaluate(tile_instruction("tilestored64", T.int8(ACC[0] + t),
                                                            T.address_of(scores[s_at]), T.int64((blocks * 32) * 4)))
                    # softmax of each row, in fp32, the probabilities as bf16
                    for r in range(32):
                        for x in T.vectorized(LANES):
                            lanes[x] = T.float32(neg_inf)
                        for c in range(blocks * 2):
                            for x in T.vectorized(LANES):
                                lanes[x] = T.max(lanes[x], scores[r * (blocks * 32) + c * 16 + x] * T.float32(scale)
                                                 + mask[b, (qb * 32 + r) * per_row, c * 16 + x])
                        # the lanes' max by halves (a chain of 16 dependent scalar maxes waited on each other)
                        for x in T.vectorized(8):
                            lanes[x] = T.max(lanes[x], lanes[x + 8])
                        for x in T.vectorized(4):
                            lanes[x] = T.max(lanes[x], lanes[x + 4])
                        for x in T.vectorized(2):
                            lanes[x] = T.max(lanes[x], lanes[x + 2])
                        row[0] = T.max(lanes[0], lanes[1])
                        for x in T.vectorized(LANES):
                            lanes[x] = T.float32(0)
                        for c in range(blocks * 2):
                            for x in T.vectorized(LANES):
                                scores[r * (blocks * 32) + c * 16 + x] = fast_exp(
                                    scores[r * (blocks * 32) + c * 16 + x] * T.float32(scale)
                                    + mask[b, (qb * 32 + r) * per_row, c * 16 + x] - row[0])
                                lanes[x] = lanes[x] + scores[r * (blocks * 32) + c * 16 + x]
                        for x in T.vectorized(8):
                            lanes[x] = lanes[x] + lanes[x + 8]
                        for x in T.vectorized(4):
                            lanes[x] = lanes[x] + lanes[x + 4]
                        for x in T.vectorized(2):
                            lanes[x] = lanes[x] + lanes[x + 2]
                        row[1] = lanes[0] + lanes[1]
                        # a row whose keys are all masked with -inf: probabilities 0 (torch's export zeroes its NaNs)
                        row[1] = T.Select(row[0] == T.float32(neg_inf), T.float32(0), T.float32(1) / row[1])
                        for c in range(blocks * 2):
                            for x in T.vectorized(LANES):
                                probs[r * (blocks * 32) + c * 16 + x] = bf16_bits(
                                    scores[r * (blocks * 32) + c * 16 + x] * row[1])
                    # context: 32 queries x 32 columns of D at a time, the keys in steps of 32
                    for cb in range(col_blocks):
                        zero_accumulators(acc)
                        for kb in range(blocks):
                            for t in T.unroll(2):
                                a_at = t * 16 * (blocks * 32) + kb * 32
                                b_at = ((head * (D // 16) + cb * 2 + t) * blocks * 16 + kb * 16) * 16
                                if emulate:
                                    for r, x in T.grid(TILE_ROWS, 32):
                                        a_tiles[t, r, x] = probs[a_at + r * (blocks * 32) + x]
                                        b_tiles[t, r, x] = T.Cast("uint16", vf[b_at + r * 16 + x // 2] >> T.Cast(
                                            "uint32", 16 * (x % 2)))
                                else:
                                    T.evaluate(tile_instruction("tileloadd64", T.int8(A_TILES[0] + t),
                                                       T.address_of(probs[a_at]), T.int64((blocks * 32) * 2)))
                                    T.evaluate(tile_instruction("tileloadd64", T.int8(B_TILES[0] + t),
                                                       T.address_of(vf[b_at]), T.int64(TILE_BYTES)))
                            tile_products(acc, a_tiles, b_tiles)
                        for t in T.unroll(4):
                            o_at = ((b * (blocks * 32) + qb * 32 + t // 2 * 16) * H + h) * D + cb * 32 + t % 2 * 16
                            if emulate:
                                for r, x in T.grid(TILE_ROWS, 16):
                                    of[o_at + r * H * D + x] = acc[t, r, x]
                            else:
                                T.evaluate(tile_instruction("tilestored64", T.int8(ACC[0] + t),
                                                            T.address_of(of[o_at]), T.int64(H * D * 4)))
                if not emulate:
                    T.evaluate(tile_instruction("tilerelease"))

    return kernel


def schedule_tile_attention(func: tirx.PrimFunc, emulate: bool = False) -> tirx.PrimFunc | None:
    """The tile kernel for an ``attention_func`` kernel (TILE_ATTENTION_ATTR), None for any other."""
    if not (func.attrs and TILE_ATTENTION_ATTR in func.attrs):
        return None
    heads, head_dim, scale, per_query = func.attrs[TILE_ATTENTION_ATTR]
    kernel = tile_attention_kernel(int(heads), int(head_dim), float(scale), bool(int(per_query)), emulate)
    for key, value in func.attrs.items():  # (its TILE_ATTENTION_ATTR too: analysis counts its flops by it)
        kernel = kernel.with_attr(key, value)
    return kernel.with_attr("tirx.is_scheduled", True).with_attr(AMX_ATTR, not emulate)


def schedule_tile_operand(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """A tile_attention_q / _k / _v conversion (the slices and transposes that feed it inlined): in parallel
    over (batch, head, and the query row or the tile), each row of the output one vector (Q's row of d, a B
    tile's row of 16 columns)."""
    sch = Schedule(func)
    name = next((n for n in OPERANDS if has_block(func, n)), None)
    if name is None:
        return None
    inline_elementwise(sch, sch.get_sblock("root"))
    loops = sch.get_loops(sch.get_sblock(name))
    sch.parallel(sch.fuse(*loops[:3]))
    row = loops[3:] if len(loops) == 4 else loops[4:]  # q [B, H, L, D]; k, v: [B, H, tile, tile row, ...]
    sch.vectorize(sch.fuse(*row) if len(row) > 1 else row[0])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


class TileAttention(ScheduleRule):
    """The attention's one kernel (tvmdm.transform.tile_attention) on the tile units: the pass only makes such
    kernels for targets with AMX-BF16 (the emulated kernel where schedules.amx.EMULATE)."""

    name = "amx attention"

    def schedule(self, func, options):
        if not (options.on_cpu and (has_amx_bf16(options.target) or amx.EMULATE)):
            return None
        return schedule_tile_attention(func, emulate=amx.EMULATE) or schedule_tile_operand(func)
