"""Tolerances for comparing fp32 results, derived from fp32's error bounds instead of picked by hand.

A sum (or dot product) of n fp32 terms, computed in any order, is off its exact value by at most
gamma(n) * sum(|term|), gamma(n) = n u / (1 - n u), u = eps / 2 (Higham, Accuracy and Stability of Numerical
Algorithms, 2nd ed., 3.1). Two fp32 computations of the same value (tvmdm and a reference, one process and
two) each carry such an error, so they differ by at most twice it. A value computed through a chain of
reductions (a layer's forward and backward pass) carries, to first order, the sum of the chain's gammas:
``length`` is then the total reduction length along the chain (chain_length).

AdamW is the exception that made hand-picked tolerances fail: it divides the moment m by sqrt(v), so the
update of a weight whose gradient is within its rounding error of zero is decided by the rounding (its sign
can flip), however small that error. adam_weight_bound propagates a gradient error bound through the update
element by element: tight where gradients are well above their error, up to 2 lr a step where they are not.
"""
from __future__ import annotations

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)


def gamma(n: int, eps: float = EPS32) -> float:
    u = eps / 2
    return n * u / (1 - n * u)


def rounding_bound(length: int, magnitude, eps: float = EPS32):
    """How far two fp32 computations of a value summed from ``length`` terms whose magnitudes add up to (at
    most) ``magnitude`` can differ: 2 gamma(length) magnitude (element-wise where ``magnitude`` is an array)."""
    return 2 * gamma(length, eps) * np.asarray(magnitude, dtype=np.float64)


def assert_within(actual, expected, bound, err_msg: str = "") -> None:
    """|actual - expected| <= bound element-wise, naming the worst element where not."""
    expected = np.asarray(expected, dtype=np.float64)
    diff = np.abs(np.asarray(actual, dtype=np.float64) - expected)
    bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), diff.shape)
    if diff.size and not np.all(diff <= bound):
        worst = np.unravel_index(np.argmax(diff - bound), diff.shape)
        raise AssertionError(f"{err_msg}: |difference| {float(diff[worst]):.3g} above its fp32 bound "
                             f"{float(bound[worst]):.3g} at {worst}")


def assert_within_rounding(actual, expected, length: int, magnitude=None, err_msg: str = "") -> None:
    """actual == expected up to rounding_bound; ``magnitude`` defaults to max |expected| (the tensor's scale: a
    bound on sum(|term|) only up to the terms' cancellation, so give the real sum where it is known, e.g.
    |A| @ |B| for A @ B)."""
    expected = np.asarray(expected, dtype=np.float64)
    if magnitude is None:
        magnitude = np.abs(expected).max() if expected.size else 0.0
    assert_within(actual, expected, rounding_bound(length, magnitude), f"{err_msg} (reduction length {length})")


def chain_length(hidden: int, heads: int, ffn: int, batch: int, seq: int) -> int:
    """The total reduction length along a BERT encoder layer's training step, forward and backward: the
    longest chain of sums any gradient value depends on. Forward: Q/K/V (hidden), scores (head dim), softmax
    (seq), context (seq), output (hidden), LayerNorm (hidden: mean, variance), FFN up (hidden), down (ffn),
    LayerNorm (hidden); backward: the same contractions transposed (their other axes) and a weight
    gradient's sum over all batch x seq rows."""
    head = hidden // heads
    forward = hidden + head + seq + seq + hidden + 2 * hidden + hidden + ffn + 2 * hidden
    backward = ffn + hidden + 2 * hidden + hidden + seq + head + seq + head + hidden + 2 * hidden
    return forward + backward + batch * seq


def adam_weight_bound(grads: list[np.ndarray], grad_error, lr: float, weights, betas=(0.9, 0.999)) -> np.ndarray:
    """Element-wise bound on how far AdamW's weights after len(grads) steps can move when each step's gradient
    ``grads[t]`` is off by at most ``grad_error`` (a scalar or per step); ``weights``: their values (for the
    update's own roundings).

    Step t's update is lr m^ / sqrt(v^) (weight decay is exact up to one rounding). With relative gradient
    errors d <= delta_t = max over steps s <= t of err_s / |g_s|, m^ moves by at most delta_t M^ (M^: m^ of the
    |g_s|) and sqrt(v^) by a relative delta_t, so the update moves by at most about 2 delta_t M^ / sqrt(v^);
    never by more than the two updates' sizes, 2 M^ / sqrt(v^) (a gradient within its error of zero)."""
    b1, b2 = betas
    errors = np.broadcast_to(np.asarray(grad_error, dtype=np.float64), (len(grads),))
    m_abs = np.zeros_like(grads[0], dtype=np.float64)
    v = np.zeros_like(m_abs)
    delta = np.zeros_like(m_abs)
    bound = np.zeros_like(m_abs)
    for t, (g, err) in enumerate(zip(grads, errors), start=1):
        g = np.abs(np.asarray(g, dtype=np.float64))
        m_abs = b1 * m_abs + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        with np.errstate(divide="ignore", invalid="ignore"):
            delta = np.maximum(delta, np.where(g > 0, err / g, np.inf))
            size = np.where(v > 0, (m_abs / (1 - b1 ** t)) / np.sqrt(v / (1 - b2 ** t)), 0.0)
        # first order in delta, with a factor 2 margin for the second-order terms and the weights' own drift
        bound += lr * np.minimum(4 * delta, 2.0) * size
    return bound + rounding_bound(3 * len(grads), np.abs(weights))  # the update's own roundings (3 a step)
