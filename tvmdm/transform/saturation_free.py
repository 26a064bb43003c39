"""An order of K under which AVX2's byte dot product cannot saturate: exact int8 contractions at its speed.

Without VNNI, the fast u8 x s8 dot product is vpmaddubsw: it multiplies 32 uint8 activations by 32 int8 weights
and adds adjacent products in pairs into int16 lanes, saturating a pair sum beyond [-32768, 32767]; a vpmaddwd by
ones then adds pairs of those into int32. onnxruntime's AVX2 kernels use it and saturate (a row of 255s times a
column of 127s: 1048544 where the product is 2072640). vpmaddwd on int16 pairs is exact but takes 1.5x the
instructions (2 Zen 4 cores, [1024, 768] x [768, 3072]: 220 GOP/s against 320).

A pair (k1, k2) of a weight column cannot saturate for any activations a1, a2 in [0, 255] when
|w[k1] + w[k2]| <= 128: same signs give at most 255 * 128 = 32640, opposite signs at most 255 * |w| <= 32640.
So the contraction is exact on vpmaddubsw when K's rows are ordered so that every pair the instruction forms
(rows 2i and 2i+1 of the order) obeys that in every column; the activations are then read in the same order
(the kernel that quantizes them writes them so). Rows with no large entry pair with anything; trained and
random weights under symmetric per-tensor quantization have few large entries, and a greedy matching (fewest
partners first) finds such an order (BERT-base widths: every contraction, Q/K/V sharing one order). Weights
too dense in large values have none: the caller keeps the exact vpmaddwd path for them.
"""
from __future__ import annotations

import numpy as np

PAIR_LIMIT = 128  # the largest |w[k1] + w[k2]| a pair may have: 255 * 128 = 32640 <= 32767
_CHUNK = 4096  # large entries checked per step (a [chunk, K] boolean)


def can_pair(weight: np.ndarray) -> np.ndarray:
    """[K, K] bool: rows k1 and k2 of ``weight`` ([K, N] int8) may form a pair (see the module doc)."""
    w = weight.astype(np.int16)
    columns = np.ascontiguousarray(w.T)  # [N, K]: a column's K values contiguous
    k = w.shape[0]
    clash = np.zeros((k, (k + 7) // 8), np.uint8)  # bit-packed along its second axis
    # a pair over the limit holds an entry over half of it: only those entries' columns need checking
    rows, cols = np.nonzero(np.abs(w) > PAIR_LIMIT // 2)
    for start in range(0, len(rows), _CHUNK):
        r, c = rows[start:start + _CHUNK], cols[start:start + _CHUNK]
        over = np.abs(columns[c] + w[r, c][:, None]) > PAIR_LIMIT  # [entries, K]
        starts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])  # np.nonzero lists the entries row by row
        clash[r[starts]] |= np.bitwise_or.reduceat(np.packbits(over, axis=1), starts, axis=0)
    clash = np.unpackbits(clash, axis=1, count=k).view(bool)
    clash |= clash.T
    np.fill_diagonal(clash, True)
    return ~clash


def saturation_free_order(weight: np.ndarray) -> np.ndarray | None:
    """A permutation of ``weight``'s K rows ([K, N] int8, K even) whose consecutive pairs cannot saturate
    vpmaddubsw, or None where the greedy matching finds none. Weights that share their activations (Q, K, V)
    are given concatenated along N: one order serves them all."""
    k = weight.shape[0]
    if k % 2:
        return None
    allowed = can_pair(weight)
    free = np.ones(k, bool)
    partners = allowed.sum(axis=1)  # among the free rows
    order = np.empty(k, np.int64)
    for i in range(0, k, 2):
        first = int(np.argmin(np.where(free, partners, k + 1)))  # the row with fewest choices left goes first
        choices = np.flatnonzero(allowed[first] & free)
        if len(choices) == 0:
            return None
        second = int(choices[np.argmin(partners[choices])])
        free[first] = free[second] = False
        partners -= allowed[first].astype(partners.dtype) + allowed[second]
        order[i], order[i + 1] = first, second
    return order


def is_saturation_free(weight: np.ndarray, order: np.ndarray) -> bool:
    """Whether ``order`` (a permutation of K) pairs ``weight``'s rows within the limit in every column."""
    pairs = weight.astype(np.int16)[order].reshape(len(order) // 2, 2, -1)
    return bool((np.abs(pairs[:, 0] + pairs[:, 1]) <= PAIR_LIMIT).all())
