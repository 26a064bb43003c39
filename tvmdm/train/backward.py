"""Rewrites of the backward graph that Relax's Gradient pass writes, each a module pass over every Relax function
of a training module (loss_and_grads, train_step; inference's main has nothing to match).

  flat_weight_gradients - Gradient writes the weight gradient of a [B, S, K] x [K, N] contraction as
                          collapse_sum_to(matmul(permute_dims(X), dY), [K, N]): B batched products with
                          only S rows each (a short reduction), a [B, K, N] intermediate written and read
                          back, and a transposed copy of X. It is one contraction over all B*S rows:
                          X^T dY with X and dY viewed as [B*S, K] and [B*S, N]; FuseOps folds the
                          transposed read into the contraction, so X is not copied either.
  transposed_left_contractions
                        - matmul(permute_dims(A), B) of 2-D A and B (those weight gradients) -> one
                          "matmul_tn" kernel reading A in place: FuseOps fuses no producer into a
                          contraction, so permute_dims would be a kernel copying the activations (~15 ms a
                          step on the base layer). Not the input gradients' dY W^T: TVM's CPU schedules
                          vectorize over the output columns, which a transposed W makes strided reads; the
                          weight's transpose is the packing that contraction needs (and cheap: weights are
                          smaller than activations here).
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx

from tvmdm.transform.ir import bindings_of, call_op, function_pass, rewritten, static_shape, users_of
from tvmdm.transform.kernels import int64_dims, private_func


def batched_weight_gradient(value, bindings: dict, users: dict):
    """(matmul var, X, dY, rows) when ``value`` is collapse_sum_to(matmul(permute_dims(X, [.., -1, -2]), dY))
    to 2-D with X and dY of equal static leading dims (the matmul read nowhere else), else None."""
    if call_op(value) != "relax.collapse_sum_to" or len(value.ty.shape.values) != 2:
        return None
    mm = value.args[0]
    if not isinstance(mm, relax.Var) or users.get(mm, 0) != 1 or call_op(bindings.get(mm)) != "relax.matmul":
        return None
    xt, dy = bindings[mm].args
    bound = bindings.get(xt)
    if call_op(bound) != "relax.permute_dims" or bound.attrs.axes is None:
        return None
    x = bound.args[0]
    x_shape, dy_shape = static_shape(x), static_shape(dy)
    if x_shape is None or dy_shape is None or len(x_shape) < 3 or x_shape[:-1] != dy_shape[:-1]:
        return None
    rank = len(x_shape)
    if [int(a) for a in bound.attrs.axes] != list(range(rank - 2)) + [rank - 1, rank - 2]:
        return None
    return mm, x, dy, int(np.prod(x_shape[:-1]))


def _flatten_weight_gradients(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    func = mod[name]
    bindings, users = bindings_of(func), users_of(func)
    targets = {var: found for var, value in bindings.items()
               if (found := batched_weight_gradient(value, bindings, users)) is not None}
    if not targets:
        return mod
    replaced = {found[0] for found in targets.values()}

    @relax.expr_functor.mutator
    class Flatten(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            if binding.var in replaced:
                return None  # the batched matmul: its one reader is rewritten below
            if binding.var not in targets:
                return super().visit_var_binding_(binding)
            _, x, dy, rows = targets[binding.var]
            bb = self.builder_
            x2 = bb.emit(relax.op.reshape(self.visit_expr(x), [rows, static_shape(x)[-1]]))
            dy2 = bb.emit(relax.op.reshape(self.visit_expr(dy), [rows, static_shape(dy)[-1]]))
            xt = bb.emit(relax.op.permute_dims(x2, [1, 0]))
            self.set_var_remap(binding.var, bb.emit(relax.op.matmul(xt, dy2)))
            return None

    return rewritten(mod, name, Flatten(mod))


def flat_weight_gradients() -> tvm.transform.Pass:
    """Every weight gradient collapse_sum_to(matmul(X^T, dY)) -> matmul(X^T, dY) over the flattened rows (the
    batched transposes left dead are removed)."""
    return tvm.transform.Sequential([function_pass("tvmdm.FlatWeightGradients", _flatten_weight_gradients),
                                     relax.transform.DeadCodeElimination()], name="tvmdm.FlatWeightGradients")


def matmul_tn_func(rows: int, k: int, n: int) -> tirx.PrimFunc:
    """C[K, N] = sum over r of A[r, K] B[r, N]: a weight gradient, its left operand read transposed."""
    a = te.placeholder(int64_dims((rows, k)), "float32", name="a")
    b = te.placeholder(int64_dims((rows, n)), "float32", name="b")
    r = te.reduce_axis((tirx.IntImm("int64", 0), tirx.IntImm("int64", rows)), name="r")
    out = te.compute(int64_dims((k, n)), lambda i, j: te.sum(a[r, i] * b[r, j], axis=r), name="matmul_tn")
    return private_func(te.create_prim_func([a, b, out])).with_attr("op_pattern", 4)  # epilogues may fuse


def _transposed_2d(value, bindings: dict):
    """A when ``value`` is permute_dims(A, [1, 0]) of a static 2-D fp32 A, else None."""
    bound = bindings.get(value)
    if call_op(bound) != "relax.permute_dims":
        return None
    a = bound.args[0]
    shape = static_shape(a)
    axes = None if bound.attrs.axes is None else [int(x) for x in bound.attrs.axes]
    return a if shape is not None and len(shape) == 2 and axes in (None, [1, 0]) and a.ty.dtype == "float32" \
        else None


def _transposed_left(value, bindings: dict):
    """(A, B) for matmul(permute_dims(A), B) of static 2-D fp32 operands with equal rows, else None."""
    if call_op(value) != "relax.matmul":
        return None
    x, b = value.args
    a, b_shape = _transposed_2d(x, bindings), static_shape(b)
    if a is None or b_shape is None or len(b_shape) != 2 or b.ty.dtype != "float32" or \
            static_shape(a)[0] != b_shape[0]:
        return None
    return a, b


def _rewrite_transposed(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    func = mod[name]
    bindings = bindings_of(func)
    targets = {var: found for var, value in bindings.items() if (found := _transposed_left(value, bindings))}
    if not targets:
        return mod

    @relax.expr_functor.mutator
    class ReadTransposed(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            if binding.var not in targets:
                return super().visit_var_binding_(binding)
            a, b = targets[binding.var]
            (rows, k), n = static_shape(a), static_shape(b)[1]
            gv = self.builder_.add_func(matmul_tn_func(rows, k, n), "matmul_tn")
            self.set_var_remap(binding.var, self.builder_.emit(relax.call_tir(
                gv, [self.visit_expr(a), self.visit_expr(b)], relax.TensorType([k, n], "float32"))))
            return None

    return rewritten(mod, name, ReadTransposed(mod))


def transposed_left_contractions() -> tvm.transform.Pass:
    """matmul(permute_dims(A), B) of 2-D operands -> one matmul_tn kernel reading A in place (the permute_dims
    left dead are removed)."""
    return tvm.transform.Sequential([function_pass("tvmdm.TransposedLeftContractions", _rewrite_transposed),
                                     relax.transform.DeadCodeElimination()], name="tvmdm.TransposedLeft")
