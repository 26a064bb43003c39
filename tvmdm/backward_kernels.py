"""The paper's backward kernels as dataflow patterns over the graph Relax's Gradient writes (fusion="paper" in
a training step); FuseOpsByPattern makes each match one kernel and fuse.inline_pattern_kernels keeps its
element-wise intermediates out of memory.

  blnrd - LayerNorm's input gradient: the statistics recomputed, dx = rstd * (dxhat - mean(dxhat)
          - xhat * mean(dxhat * xhat)) with dxhat = dy * gamma, in one pass over each row (stock fusion: five
          kernels and four row-sized intermediates). The residual's gradient is added where it is produced
          (the input-gradient contraction's epilogue), dropout's mask by the next kernel.
  bsb   - LayerNorm's scale and bias gradients, sum(dy * xhat) and sum(dy) over the rows, side by side in one
          reduction with the statistics recomputed: one kernel reading dy once (stock: three or more).
  bs    - softmax's gradient with the scale folded in: (dp - sum(dp * p)) * p * scale, one kernel (stock: three).

They match what tvmdm.compat's LayerNorm gradient and TVM's softmax gradient emit (tests check that they do).
"""
from __future__ import annotations

from tvm.relax.dpl import is_const, is_op, is_tuple, wildcard

BACKWARD_KERNELS = ("blnrd", "bsb", "bs")


def _mean(x):
    return is_op("relax.mean")(x)


def _multiply(a, b):
    return is_op("relax.multiply")(a, b)


def _normalized(x):
    """(xhat, rstd) of LayerNorm's recomputed statistics of ``x``, as the gradient writes them."""
    centered = is_op("relax.subtract")(x, _mean(x))
    rstd = is_op("relax.rsqrt")(is_op("relax.add")(_mean(_multiply(centered, centered)), is_const()))
    return _multiply(centered, rstd), rstd


def blnrd_pattern():
    x, gamma, dy = wildcard(), wildcard(), wildcard()
    xhat, rstd = _normalized(x)
    dxhat = _multiply(dy, gamma)
    centered_grad = is_op("relax.subtract")(dxhat, _mean(dxhat))
    projection = _multiply(xhat, _mean(_multiply(dxhat, xhat)))
    return _multiply(rstd, is_op("relax.subtract")(centered_grad, projection))


def bsb_pattern():
    x, dy = wildcard(), wildcard()
    xhat, _ = _normalized(x)
    return is_op("relax.sum")(is_op("relax.concat")(is_tuple([_multiply(dy, xhat), dy])))


def bs_pattern():
    probs, grad = wildcard(), wildcard()
    softmax_grad = _multiply(is_op("relax.subtract")(grad, is_op("relax.sum")(_multiply(grad, probs))), probs)
    return _multiply(softmax_grad, is_const()) | is_op("relax.divide")(softmax_grad, is_const()) | softmax_grad


def backward_patterns() -> list[tuple[str, object]]:
    """(kernel name, pattern), most specific first."""
    return [("blnrd", blnrd_pattern()), ("bsb", bsb_pattern()), ("bs", bs_pattern())]
