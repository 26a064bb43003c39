"""Dropout for the training step: keep-masks made on the host per step (seeded), multiplied in by the graph.

Relax has no random-number op (and ``nn.dropout`` legalizes to identity, without a gradient), so the training
graph takes one mask input per dropout site; ``tvmdm.core.training.masks_for_step`` draws them from
``(seed, step)`` alone, so a run is reproducible and a resumed run draws the masks it would have drawn. A mask holds 0 or 1/(1-p), as
torch's inverted dropout scales kept values.

Sites, where HF BERT applies dropout (found in the imported graph, in binding order):
  embeddings        the output of a LayerNorm not fed by a residual (the embedding sum's LayerNorm);
  attention_probs   every softmax output;
  hidden            the dense branch of every residual add that feeds a LayerNorm (attention output, FFN output).
"""
from __future__ import annotations

import tvm
from tvm import relax

from tvmdm.core.training import DropoutSite
from tvmdm.transform.ir import call_op, function_pass, rewritten




def find_sites(func: relax.Function) -> dict:
    """binding var -> (kind, operand index or None): where dropout goes. None: on the binding's own output;
    an index: on that operand of the (residual add) binding."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    producer = {b.var: b.value for b in bindings}

    def is_dense(var) -> bool:  # matmul, or add(bias, matmul) / add(matmul, bias)
        value = producer.get(var)
        if call_op(value) == "relax.matmul":
            return True
        return call_op(value) == "relax.add" and any(call_op(producer.get(a)) == "relax.matmul"
                                                     for a in value.args)

    sites = {}
    for b in bindings:
        kind = call_op(b.value)
        if kind == "relax.nn.softmax":
            sites[b.var] = ("attention_probs", None)
        elif kind == "relax.nn.layer_norm":
            source = b.value.args[0]
            residual = producer.get(source)
            if call_op(residual) == "relax.add" and any(is_dense(a) for a in residual.args):
                index = next(i for i, a in enumerate(residual.args) if is_dense(a))
                sites[source] = ("hidden", index)
            else:
                sites[b.var] = ("embeddings", None)
    return sites


def strip_exported_dropout() -> tvm.transform.Pass:
    """An export's own Dropout nodes -> their input. torch's dynamo exporter writes them even for a model in
    eval mode (inference: identity, as onnxruntime runs them); Relax's ``nn.dropout`` has no gradient, and
    the training step applies its own (``dropout=``, insert_dropout) at HF's sites, which they would hide."""

    def rewrite(mod: tvm.IRModule, name: str) -> tvm.IRModule:
        func = mod[name]
        if not any(call_op(b.value) == "relax.nn.dropout" for block in func.body.blocks for b in block.bindings):
            return mod

        @relax.expr_functor.mutator
        class Strip(relax.PyExprMutator):
            def visit_var_binding_(self, binding):
                if call_op(binding.value) != "relax.nn.dropout":
                    return super().visit_var_binding_(binding)
                x = self.visit_expr(binding.value.args[0])  # (output, mask): the mask is never read
                self.set_var_remap(binding.var, self.builder_.emit(relax.Tuple([x, x])))
                return None

        return rewritten(mod, name, Strip(mod))

    return function_pass("tvmdm.StripExportedDropout", rewrite, every_function=False)


def insert_dropout(mod: tvm.IRModule, n_inputs: int) -> tuple[tvm.IRModule, list[DropoutSite]]:
    """Rewrite main(inputs, weights) into main(inputs, masks, weights) with every site multiplied by its mask.
    Returns the module and the sites, in the order of the new mask parameters."""
    func = mod["main"]
    sites = find_sites(func)
    if not sites:
        raise ValueError("dropout: no softmax, LayerNorm or residual add found in the model")
    counts: dict[str, int] = {}
    masks: dict = {}
    order: list[DropoutSite] = []
    for block in func.body.blocks:
        for b in block.bindings:
            if b.var not in sites:
                continue
            kind, index = sites[b.var]
            ty = b.var.ty if index is None else b.value.args[index].ty
            name = f"{kind}.{counts.setdefault(kind, 0)}"
            counts[kind] += 1
            masks[b.var] = relax.Var(f"dropout_{name.replace('.', '_')}", relax.TensorType(ty.shape, ty.dtype))
            order.append(DropoutSite(name, tuple(int(d) for d in ty.shape), str(ty.dtype)))

    @relax.expr_functor.mutator
    class Insert(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            site = sites.get(binding.var)
            if site is None:
                return super().visit_var_binding_(binding)
            kind, index = site
            if index is None:  # dropout on this binding's output
                super().visit_var_binding_(binding)
                new = self.get_var_remap(binding.var)
                new = binding.var if new is None else new
                self.set_var_remap(binding.var, self.builder_.emit(relax.op.multiply(new, masks[binding.var])))
                return None
            # dropout on one operand of this residual add
            args = [self.visit_expr(a) for a in binding.value.args]
            args[index] = self.builder_.emit(relax.op.multiply(args[index], masks[binding.var]))
            self.set_var_remap(binding.var, self.builder_.emit(relax.op.add(*args)))
            return None

    body = Insert(mod).visit_expr(func).body
    params = list(func.params[:n_inputs]) + list(masks.values()) + list(func.params[n_inputs:])
    new_func = relax.Function(params, body, func.ret_ty, attrs=func.attrs)
    out = mod.shallow_copy() if hasattr(mod, "shallow_copy") else tvm.IRModule(dict(mod.functions.items()))
    out["main"] = new_func
    return out, order
