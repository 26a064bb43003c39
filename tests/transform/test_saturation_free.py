"""K orders under which AVX2's vpmaddubsw cannot saturate (tvmdm.transform.saturation_free), checked against a
numpy model of the instruction."""
import numpy as np

from tests.helpers.quantized import int8_weight
from tvmdm.transform.saturation_free import is_saturation_free, saturation_free_order


def _quantized_normal(k: int, n: int, seed: int = 0) -> np.ndarray:
    """What quantize_dynamic makes of normal weights: symmetric int8, the largest at 127 (sigma ~25)."""
    w = np.random.default_rng(seed).standard_normal((k, n))
    return np.round(w / np.abs(w).max() * 127).astype(np.int8)


def _vpmaddubsw_then_vpmaddwd(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """sum_k a[k] * w[k, n] as the instructions compute it: products of rows 2i and 2i+1 added and saturated to
    int16, then those sums added in int32."""
    products = a.astype(np.int32)[:, None] * w.astype(np.int32)
    pairs = np.clip(products[0::2] + products[1::2], -32768, 32767)
    return pairs.sum(axis=0)


def _worst_activations(w: np.ndarray) -> np.ndarray:
    """The activations that push a column's pairs furthest, each way: 255 where its weight is positive (else
    0), and 255 where it is negative."""
    return np.where(w > 0, 255, 0).astype(np.uint8), np.where(w < 0, 255, 0).astype(np.uint8)


def test_normal_weights_get_an_order_whose_pairs_cannot_saturate_where_theirs_do():
    w = _quantized_normal(512, 1536)
    identity = np.arange(512)
    assert not is_saturation_free(w, identity)  # these weights in their own order would saturate
    order = saturation_free_order(w)
    assert order is not None and sorted(order) == list(range(512))
    assert is_saturation_free(w, order)
    reordered = w[order]
    for column in (0, 7, 1535):
        for a in _worst_activations(reordered[:, column]):
            exact = a.astype(np.int32) @ reordered[:, column].astype(np.int32)
            assert _vpmaddubsw_then_vpmaddwd(a, reordered[:, column:column + 1])[0] == exact
    # in their own order the instructions lose the exact sum somewhere
    lost = [column for column in range(1536) for a in _worst_activations(w[:, column])
            if _vpmaddubsw_then_vpmaddwd(a, w[:, column:column + 1])[0] != a.astype(np.int32) @ w[:, column]]
    assert lost


def test_one_order_serves_weights_that_share_their_activations():
    q, k, v = (_quantized_normal(256, 256, seed) for seed in range(3))
    order = saturation_free_order(np.concatenate([q, k, v], axis=1))
    assert order is not None and all(is_saturation_free(w, order) for w in (q, k, v))


def test_weights_dense_in_large_values_and_odd_k_get_none():
    assert saturation_free_order(int8_weight(np.random.default_rng(0), 64, 48, full_range=True)) is None
    assert saturation_free_order(np.full((8, 4), 127, np.int8)) is None
    assert saturation_free_order(_quantized_normal(63, 16)) is None


def test_pairs_within_the_limit_are_exact_at_the_extremes():
    # the bound itself: |w1 + w2| <= 128 keeps 255 * w1 + 255 * w2 (same signs) and 255 * w (opposite) in int16
    for w1, w2 in [(64, 64), (127, 1), (-128, 0), (-64, -64), (127, -128), (100, 28)]:
        w = np.array([[w1], [w2]], np.int8)
        assert is_saturation_free(w, np.arange(2))
        for a in _worst_activations(w[:, 0]):
            assert _vpmaddubsw_then_vpmaddwd(a, w)[0] == a.astype(np.int32) @ w[:, 0].astype(np.int32)
    assert not is_saturation_free(np.array([[65], [64]], np.int8), np.arange(2))
    assert _vpmaddubsw_then_vpmaddwd(np.array([255, 255], np.uint8), np.array([[65], [64]], np.int8))[0] == 32767
