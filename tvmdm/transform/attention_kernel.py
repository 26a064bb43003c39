"""The paper's attention kernels, SM and the context contraction, as one kernel (CPU inference).

SM writes the probabilities P [B, h, S, S] (fp32) and the context contraction reads them back: at BERT-base's
(8, 128) 6.3 MB each way, for work that takes a few hundred microseconds on the vector units. Inference reads P
nowhere else, so ``attention_kernel()`` merges each SM call whose output only the context contraction reads
into one kernel (a Primitive function of the two, made one PrimFunc by FuseTIR, named ATTENTION_KERNEL). Its
schedule (schedules.attention) computes a few query rows' probabilities and, while they are in L1, their
context rows: P never goes to memory. This is the paper's fusion carried one step further than its SM kernel,
which training needs (the backward pass reads P).

Only static pairs: in a module of symbolic (batch, seq) the kernel's per-tile buffers are of symbolic size,
allocated from the runtime's workspace pool at every tile. Standalone that kernel was as fast as the two it
replaces, but in place it and its neighbours slowed: BERT-base layer at (8, 128) on 2 Sapphire Rapids cores,
int8 1.17x the time, fp32 2.0x (its packed contractions twice as slow beside it).

Preconditions: after FuseTIR, the paper level's kernels named by name_paper_kernels ("sm",
"attention_context"); an inference module on a CPU target (a training step's backward reads P: its SM has two
readers and is left alone).
"""
from __future__ import annotations

import tvm
from tvm import relax

from tvmdm.transform.ir import (bindings_of, merging_pass, op_name, primitive_call, readers_of, rewritten,
                               static_shape, users_of)

ATTENTION_KERNEL = "attention"
SM_KERNEL, CONTEXT_KERNEL = "sm", "attention_context"


def attention_kernel(provenance: dict | None = None) -> tvm.transform.Pass:
    """See the module doc. ``provenance`` (fusion's kernel -> ops record), if given, learns the merged
    kernels' ops."""
    return merging_pass("tvmdm.AttentionKernel", _rewrite, provenance)


def _kernel_call(value, name: str) -> bool:
    return isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.call_tir")) \
        and op_name(value.args[0].name_hint) == name and len(value.args) == 2


def _pairs(func: relax.Function) -> dict:
    """context var -> SM var, for each SM whose output only one context call reads (and nothing else: not a
    tuple, not the function's result)."""
    bindings, readers, reads = bindings_of(func), readers_of(func), users_of(func)
    pairs = {}
    for var, value in bindings.items():
        users = readers.get(var, [])
        if not _kernel_call(value, SM_KERNEL) or len(users) != 1 or reads.get(var) != 1 or static_shape(var) is None:
            continue
        context = bindings[users[0]]
        if _kernel_call(context, CONTEXT_KERNEL) and sum(a.same_as(var) for a in context.args[1].fields) == 1:
            pairs[users[0]] = var
    return pairs


def _rewrite(mod: tvm.IRModule, name: str, provenance: dict) -> tuple[tvm.IRModule, bool]:
    func = mod[name]
    pairs = _pairs(func)
    if not pairs:
        return mod, False
    bindings = bindings_of(func)
    merged_sm = set(pairs.values())

    @relax.expr_functor.mutator
    class Merge(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            if binding.var in merged_sm:
                return None  # computed inside the attention kernel
            sm_var = pairs.get(binding.var)
            if sm_var is None:
                return super().visit_var_binding_(binding)
            sm, context = bindings[sm_var], binding.value
            sm_args = [self.visit_expr(a) for a in sm.args[1].fields]
            context_args = [None if a.same_as(sm_var) else self.visit_expr(a) for a in context.args[1].fields]

            def body(fb, inner):
                probs = fb.emit(relax.call_tir(sm.args[0], [inner(a) for a in sm_args], sm_var.ty))
                return relax.call_tir(context.args[0], [probs if a is None else inner(a) for a in context_args],
                                      binding.var.ty)

            args = [a for a in sm_args + context_args if a is not None]
            call = primitive_call(self.builder_, ATTENTION_KERNEL, args, body)
            provenance[call.op.name_hint] = provenance.get(sm.args[0].name_hint, [SM_KERNEL]) + \
                provenance.get(context.args[0].name_hint, [CONTEXT_KERNEL])
            self.set_var_remap(binding.var, self.builder_.emit(call))
            return None

    return rewritten(mod, name, Merge(mod)), True
