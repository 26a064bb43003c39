"""What a Relax function calls, for the graph passes' tests."""


def op_names(func) -> list[str]:
    """The names of the ops ``func`` calls (calls of GlobalVars left out), in post order."""
    import tvm
    from tvm import relax

    ops = []
    relax.analysis.post_order_visit(func.body, lambda e: ops.append(e.op.name) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    return ops
