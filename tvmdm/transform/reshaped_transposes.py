"""fold_reshaped_transposes: reshape(permute_dims(reshape(x))) that only moves x's axes -> permute_dims(x).

torch's dynamo exporter writes the keys' transpose of scaled_dot_product_attention (K [B, h, S, d] -> K^T
[B, h, d, S]) as a reshape to [B*h, S, d], a transpose of the last two axes and a reshape back to [B, h, d, S].
Nothing downstream reads that chain as a transpose: absorb_transposes folds permute_dims into the attention's
contractions, but not reshapes, so each layer kept a kernel that copied K^T out of the packed QKV output
(fused_strided_slice_squeeze_transpose_reshape_transpose_reshape) and an SM reading the copy.

The chain is a permutation of x's axes when the first reshape only merges runs of consecutive axes, the
permute_dims moves those runs whole, and the second reshape splits each run back into its axes. Then it is
one permute_dims of x, which the passes after this one treat as any exporter's transpose.

Preconditions: ``main`` before LegalizeOps, the three tensors' shapes known (static, or symbolic dims that
tvm.sym.Analyzer can compare: batch * 12 against batch and 12). Anything else is left as it is.
"""
from __future__ import annotations

import tvm
from tvm import relax

from tvmdm.transform.ir import bindings_of, call_op, main_pass, permutation


def _dims(expr) -> list | None:
    shape = getattr(expr.ty, "shape", None)
    values = getattr(shape, "values", None)
    return None if values is None else list(values)


def _merged_runs(dims: list, merged: list, equal) -> list[list[int]] | None:
    """For each dim of ``merged``, the run of consecutive axes of ``dims`` whose sizes multiply to it (size-1
    axes may join any run); None when ``merged`` is not such a merge of ``dims``."""
    runs, axis = [], 0
    for size in merged:
        run, product = [], 1
        while axis < len(dims) and not equal(product, size):
            run.append(axis)
            product = product * dims[axis]
            axis += 1
        if not equal(product, size):
            return None
        runs.append(run)
    while axis < len(dims):  # trailing size-1 axes
        if not equal(dims[axis], 1) or not runs:
            return None
        runs[-1].append(axis)
        axis += 1
    return runs


def permutation_of(source: list, merged: list, axes: list[int], result: list, equal) -> list[int] | None:
    """The axes of ``source`` that reshape(permute_dims(reshape(x, merged), axes), result) lays out in order,
    when that chain only permutes x's axes; else None."""
    runs = _merged_runs(source, merged, equal)
    if runs is None:
        return None
    order = [a for run in (runs[i] for i in axes) for a in run]
    if len(order) != len(result) or not all(equal(source[a], size) for a, size in zip(order, result)):
        return None
    return order


def fold_reshaped_transposes() -> tvm.transform.Pass:
    """reshape(permute_dims(reshape(x))) -> permute_dims(x) (or x) where the chain only permutes x's axes (see
    the module doc); the old chain is left to DeadCodeElimination."""
    analyzer = tvm.sym.Analyzer()

    def equal(a, b) -> bool:
        return bool(analyzer.can_prove_equal(a, b))

    @main_pass("FoldReshapedTransposes")
    def rewrite(mod, func):
        values = bindings_of(func)
        folded = {}
        for var, value in values.items():
            if call_op(value) != "relax.reshape":
                continue
            permuted = value.args[0]
            transpose = values.get(permuted)
            if call_op(transpose) != "relax.permute_dims" or call_op(values.get(transpose.args[0])) != "relax.reshape":
                continue
            source = values[transpose.args[0]].args[0]
            shapes = [_dims(e) for e in (source, transpose.args[0], var)]
            if any(s is None for s in shapes):
                continue
            order = permutation_of(shapes[0], shapes[1], permutation(transpose), shapes[2], equal)
            if order is not None:
                folded[var] = (source, order)
        if not folded:
            return None

        @relax.expr_functor.mutator
        class Fold(relax.PyExprMutator):
            def visit_var_binding_(self, binding):
                if binding.var not in folded:
                    return super().visit_var_binding_(binding)
                source, order = folded[binding.var]
                new = self.visit_expr(source)
                # a dataflow block's output stays one (an identity chain binds x to it)
                emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else \
                    self.builder_.emit_output
                if order != list(range(len(order))):
                    new = emit(relax.op.permute_dims(new, order))
                elif not isinstance(binding.var, relax.DataflowVar):
                    new = emit(new)
                self.set_var_remap(binding.var, new)
                return None

        return Fold(mod).visit_expr(func).body

    return tvm.transform.Sequential([rewrite, relax.transform.DeadCodeElimination()],
                                    name="tvmdm.FoldReshapedTransposes")
