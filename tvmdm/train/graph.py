"""The training graph as Relax passes: forward + loss -> reverse-mode gradient -> AdamW update, one function.

    main(inputs..., weights...)                                   (the imported ONNX model)
 -> loss(inputs..., target, weights...)                           add_loss
 -> loss_adjoint(...) -> (loss, (grad_w...))                      relax.transform.Gradient
 -> train_step(inputs..., target, weights..., m..., v..., decay, step_size, bc2_sqrt)
        -> (loss, weights'..., m'..., v'...)                     add_train_step

Everything stays in one dataflow block, so FuseOps can fuse the update's element-wise work and the backward
kernels like the forward ones. The AdamW scalars that change per step (bias corrections, learning rate) are
inputs, so schedules need no recompile; betas and eps are compiled in.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tvmdm.core.training import IGNORE_INDEX, AdamW

LOSSES = ("mse", "cross_entropy")


def _emit_body(bb: relax.BlockBuilder, func: relax.Function):
    """Re-emit ``func``'s bindings into the current dataflow block (its params must be in scope); returns its
    result expression. This inlines a function without a call, which Gradient could not see through."""
    for block in func.body.blocks:
        for binding in block.bindings:
            bb.emit_normalized(binding)
    return func.body.body


def loss_expr(kind, output: relax.Expr, target: relax.Expr) -> relax.Expr:
    """Mean-reduced loss of the model's first output against ``target``."""
    if callable(kind):
        return kind(output, target)
    if kind == "mse":
        diff = relax.op.subtract(output, target)
        return relax.op.mean(relax.op.multiply(diff, diff))
    if kind == "cross_entropy":
        # logits [..., classes] with int64 labels [...]: flatten to [N, C] / [N] as torch's F.cross_entropy does
        shape = [int(d) for d in output.ty.shape]
        classes, rows = shape[-1], int(np.prod(shape[:-1]))
        logits = relax.op.reshape(output, [rows, classes])
        labels = relax.op.reshape(target, [rows])
        from tvmdm.train import relax_fixes

        return relax_fixes.cross_entropy(logits, labels, classes, IGNORE_INDEX, str(output.ty.dtype))
    raise ValueError(f"unknown loss {kind!r}; choose one of {list(LOSSES)} or pass a callable")


def target_type(kind, output_type: relax.TensorType) -> relax.TensorType:
    """What ``target`` must be: labels [...] int64 for cross_entropy, else the output's own shape and dtype."""
    if kind == "cross_entropy":
        return relax.TensorType(list(output_type.shape)[:-1], "int64")
    return relax.TensorType(list(output_type.shape), output_type.dtype)


LOSS_SCALE = "loss_scale"  # the scalar input a loss-scaled training module takes after the inputs (and masks)


def add_loss_scale_input(mod: tvm.IRModule, n_inputs: int) -> tvm.IRModule:
    """main(inputs, weights) -> main(inputs, loss_scale, weights); main does not read it: add_loss does."""
    main = mod["main"]
    scale = relax.Var(LOSS_SCALE, relax.TensorType([], "float32"))
    params = list(main.params[:n_inputs]) + [scale] + list(main.params[n_inputs:])
    out = tvm.IRModule(dict(mod.functions.items()), attrs=mod.attrs)
    out["main"] = relax.Function(params, main.body, main.ret_ty, attrs=main.attrs)
    return out


def add_loss(mod: tvm.IRModule, loss, n_inputs: int, loss_scaling: bool = False) -> tvm.IRModule:
    """Add ``loss(inputs..., target, weights...)``: main's body, then the loss of its first output. With
    ``loss_scaling`` it returns (loss times the ``loss_scale`` input, the last of the inputs; the loss)."""
    main = mod["main"]
    inputs, weights = list(main.params[:n_inputs]), list(main.params[n_inputs:])
    out_type = main.ret_ty.fields[0] if isinstance(main.ret_ty, relax.TupleType) else main.ret_ty
    for p in main.params:
        if any(not isinstance(d, tvm.tirx.IntImm) for d in p.ty.shape):
            raise ValueError(f"training needs static shapes: input {p.name!r} has shape {list(p.ty.shape)}; "
                             "bind them with shapes=")
    target = relax.Var("target", target_type(loss, out_type))
    bb = relax.BlockBuilder(mod)
    with bb.function("loss", inputs + [target] + weights):
        with bb.dataflow():
            result = _emit_body(bb, main)
            output = result.fields[0] if isinstance(result, relax.Tuple) else result
            value = bb.emit_output(loss_expr(loss, output, target))
            if loss_scaling:  # (scaled loss: differentiated; the loss itself: reported, finite when that is not)
                value = relax.Tuple([bb.emit_output(relax.op.multiply(value, inputs[-1])), value])
        bb.emit_func_output(value)
    return bb.get()


def _emit_finite_flag(bb, scale, grads):
    """Loss scaling: whether every unscaled gradient is finite (a bool scalar), and the count of those that
    are not. One reduction kernel per gradient (the unscale fuses into it) and one for the total; the unscale
    itself and the skip of a non-finite step live in the AdamW kernel (_emit_adamw)."""
    counts = [bb.emit(relax.op.reshape(relax.op.sum(relax.op.astype(relax.op.logical_not(
        relax.op.isfinite(relax.op.divide(g, scale))), "float32")), [1])) for g in grads]
    bad = bb.emit(relax.op.sum(relax.op.concat(counts, axis=0)))
    return bb.emit(relax.op.equal(bad, relax.const(0.0, "float32"))), bad


def add_train_step(mod: tvm.IRModule, n_inputs: int, optimizer: AdamW, loss_scaling: bool = False) -> tvm.IRModule:
    """Differentiate ``loss`` w.r.t. the weights and add ``train_step``: gradient + AdamW, one dataflow block.
    Returns a module of ``main`` (inference), ``loss_and_grads`` (no update), ``train_step`` and
    ``apply_update`` (the AdamW update of given gradients, for data-parallel training). With ``loss_scaling``
    the last input is the loss scale: loss_and_grads returns the scaled loss and gradients, train_step unscales
    them, skips the update unless they are all finite, and returns the number of non-finite values last."""
    from tvmdm.train import relax_fixes

    relax_fixes.register_missing_gradients()
    loss = mod["loss"]
    weights = list(loss.params[n_inputs + 1:])
    # With loss scaling, loss returns (scaled loss, loss): the scaled one (index 0) is differentiated.
    adjoint = relax.transform.Gradient("loss", require_grads=weights, target_index=0)(mod)["loss_adjoint"]
    adjoint = relax.utils.copy_with_new_vars(adjoint)  # fresh vars: no sharing with main / loss
    fixed, weights = list(adjoint.params[:n_inputs + 1]), list(adjoint.params[n_inputs + 1:])
    moments = [_vars_like(kind, weights) for kind in ("m", "v")]
    decay, step_size, bc2_sqrt = _update_scalar_vars()

    bb = relax.BlockBuilder(tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint == "main"}))
    grads_fn = relax.utils.copy_with_new_vars(adjoint)  # loss and gradients without an update, for checks
    bb.add_func(grads_fn.with_attr("global_symbol", "loss_and_grads"), "loss_and_grads")
    with bb.function("train_step", fixed + weights + moments[0] + moments[1] + [decay, step_size, bc2_sqrt]):
        with bb.dataflow():
            result = _emit_body(bb, adjoint)
            loss_value, grads = result.fields[0], result.fields[1]
            grads = [grads.fields[i] if isinstance(grads, relax.Tuple) else bb.emit(relax.TupleGetItem(grads, i))
                     for i in range(len(weights))]
            extra, guard = [], None
            if loss_scaling:  # loss returned (scaled loss, loss): report the loss
                scale = fixed[n_inputs - 1]
                finite, bad = _emit_finite_flag(bb, scale, grads)
                loss_value, extra, guard = bb.emit(relax.TupleGetItem(loss_value, 1)), [bad], (scale, finite)
            updated = _emit_adamw(bb, optimizer, weights, grads, *moments, decay, step_size, bc2_sqrt, guard)
            out = bb.emit_output(relax.Tuple([loss_value, *updated, *extra]))
        bb.emit_func_output(out)
    # The update alone, for data-parallel training: gradients all-reduced between loss_and_grads and this.
    weights2, grads2, *moments2 = [_vars_like(kind, weights) for kind in ("w", "g", "m", "v")]
    scalars2 = _update_scalar_vars()
    with bb.function("apply_update", weights2 + grads2 + moments2[0] + moments2[1] + scalars2):
        with bb.dataflow():
            out = bb.emit_output(relax.Tuple(_emit_adamw(bb, optimizer, weights2, grads2, *moments2, *scalars2)))
        bb.emit_func_output(out)
    return bb.get()


def _vars_like(prefix: str, weights) -> list:
    """One fresh parameter per weight, of its type: moments, gradients, weights of another function."""
    return [relax.Var(f"{prefix}_{w.name}", w.ty) for w in weights]


def _update_scalar_vars() -> list:
    """The per-step scalar inputs of the update (AdamW.scalars gives their values)."""
    return [relax.Var(n, relax.TensorType([], "float32")) for n in ("decay", "step_size", "bc2_sqrt")]


def _emit_adamw(bb, optimizer: AdamW, weights, grads, ms, vs, decay, step_size, bc2_sqrt, guard=None) -> list:
    """torch.optim.AdamW's update: w', m', v' lists. One kernel per weight computes all three from w, g, m, v in
    one pass (a TE compute with three outputs: FuseOps would make three kernels, m' and v' being outputs of
    the step too, reading g three times and m', v' back; base layer: 3.6 ms a step against their 5.1 ms).
    ``guard`` (loss scaling): (scale, finite): the kernel divides g by the scale and keeps w, m, v unchanged
    unless ``finite``, as GradScaler's step does; without it in the kernel each weight took 4 more kernels
    (an unscale and three selects)."""
    from tvm import te

    b1, b2 = optimizer.betas

    def adamw(w, g, m, v, decay, step_size, bc2_sqrt, *scale_and_finite):
        def update(*i):
            grad = g(*i) / scale_and_finite[0]() if scale_and_finite else g(*i)
            m1 = m(*i) * b1 + grad * (1.0 - b1)
            v1 = v(*i) * b2 + grad * grad * (1.0 - b2)
            denom = te.sqrt(v1) / bc2_sqrt() + optimizer.eps
            new = (w(*i) * decay() - step_size() * m1 / denom, m1, v1)
            if not scale_and_finite:
                return new
            finite = scale_and_finite[1]()
            return tuple(tvm.tirx.if_then_else(finite, value, old(*i)) for value, old in zip(new, (w, m, v)))

        return te.compute(w.shape, update, name="adamw")

    new_w, new_m, new_v = [], [], []
    for w, g, m, v in zip(weights, grads, ms, vs):
        updated = bb.emit_te(adamw, w, g, m, v, decay, step_size, bc2_sqrt, *(guard or ()),
                             primfunc_name_hint="adamw")
        for i, out in enumerate((new_w, new_m, new_v)):
            out.append(bb.emit(relax.TupleGetItem(updated, i)))
    return new_w + new_m + new_v


def training_module(mod: tvm.IRModule, n_inputs: int, loss, optimizer: AdamW, checkpoint=False,
                    dropout: bool = False, loss_scaling: bool = False) -> tuple[tvm.IRModule, list]:
    """main(inputs, weights) -> (a module of main, loss_and_grads and train_step; the dropout sites).

    ``checkpoint`` ("attention", "layer" or False) marks the regions the backward pass recomputes instead of
    keeping. With ``dropout``, loss_and_grads and train_step take one keep-mask per site after the inputs."""
    from tvmdm.train import relax_fixes
    from tvmdm.train.backward import flat_weight_gradients
    from tvmdm.train.checkpoint import insert_checkpoints
    from tvmdm.train.dropout import insert_dropout

    mod = relax_fixes.flatten_take_indices()(mod)
    train_mod, sites = insert_dropout(mod, n_inputs) if dropout else (mod, [])
    n_graph_inputs = n_inputs + len(sites)  # the masks travel with the inputs
    if loss_scaling:  # and so does the loss scale, after them
        train_mod = add_loss_scale_input(train_mod, n_graph_inputs)
        n_graph_inputs += 1
    with_loss = add_loss(insert_checkpoints(checkpoint, n_graph_inputs)(train_mod), loss, n_graph_inputs,
                         loss_scaling)
    with_loss["main"] = mod["main"]  # inference: no dropout, no checkpoint markers
    # the weight gradients as single contractions over all rows (tvmdm.train.backward)
    return flat_weight_gradients()(add_train_step(with_loss, n_graph_inputs, optimizer, loss_scaling)), sites


def tie_transposed_copies(mod: tvm.IRModule, n_inputs: int, weights: dict) -> tuple[tvm.IRModule, dict, dict]:
    """Re-tie weights an exporter untied: torch's ONNX exporter writes a tied decoder (MaskedLM's output
    projection shares the word embeddings) as a second, transposed initializer. Trained apart, the copies
    drift apart after one step; torch trains one tensor. Each 2-d weight equal to another's transpose becomes
    ``permute_dims`` of it in main (its gradient then flows into the one tensor).

    ``weights``: name -> array in the order of main's trailing params. Returns (module, the remaining
    weights, {dropped copy: the weight it now reads})."""
    by_bytes = {}
    for name, value in weights.items():
        if value.ndim == 2:
            by_bytes.setdefault((value.shape, value.dtype.str, value.tobytes()), name)
    order = {name: i for i, name in enumerate(weights)}

    def rank(name):  # keep the tensor with the model's own name, drop the exporter's "onnx::MatMul_N"
        return (name.startswith("onnx::"), order[name])

    tied = {}
    for name, value in weights.items():
        if value.ndim != 2 or name in tied or name in tied.values():
            continue
        other = by_bytes.get((value.T.shape, value.dtype.str, np.ascontiguousarray(value.T).tobytes()))
        if other is None or other == name or other in tied or other in tied.values():
            continue
        copy, source = sorted([name, other], key=rank, reverse=True)
        tied[copy] = source
    if not tied:
        return mod, weights, {}
    main = mod["main"]
    params = dict(zip(weights, main.params[n_inputs:]))

    @relax.expr_functor.mutator
    class Tie(relax.PyExprMutator):
        def visit_dataflow_block_(self, block):
            # the copies first, as transposes of the weights they duplicate, then the block as it was
            self.builder_._begin_dataflow_block()
            for copy, source in tied.items():
                self.set_var_remap(params[copy], self.builder_.emit(relax.op.permute_dims(params[source])))
            for binding in block.bindings:
                self.visit_binding(binding)
            return self.builder_._end_block()

    body = Tie(mod).visit_expr(main).body
    kept = [n for n in weights if n not in tied]
    new_main = relax.Function(list(main.params[:n_inputs]) + [params[n] for n in kept], body, main.ret_ty,
                              attrs=main.attrs)
    out = tvm.IRModule(dict(mod.functions.items()))
    out["main"] = new_main
    return out, {n: weights[n] for n in kept}, tied
