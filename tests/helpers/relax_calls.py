"""What a Relax function calls, for the graph passes' tests."""
from tvmdm.transform.ir import call_op


def op_names(func) -> list[str]:
    """The ops ``func``'s bindings call, in order (calls of GlobalVars and other bindings left out)."""
    return [call_op(b.value) for block in func.body.blocks for b in block.bindings if call_op(b.value)]
