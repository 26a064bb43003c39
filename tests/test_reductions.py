"""Column reductions (schedules.reductions): bias and LayerNorm-parameter gradients scheduled by hand, same
numbers as numpy, taken before the logs and left out of tuning."""
import numpy as np
import tvm
from tvm import relax
from tvm.script import relax as R

from schedules.reductions import apply_reduction_schedules, is_column_reduction
from tvmdm.fuse import lowering_passes


def _lowered(mod):
    return tvm.transform.Sequential(lowering_passes() + [relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)


@tvm.script.ir_module
class BiasAndScaleGradients:
    @R.function
    def main(dy: R.Tensor((4, 8, 96), "float32"), xhat: R.Tensor((4, 8, 96), "float32")):
        with R.dataflow():
            db = R.collapse_sum_to(dy, R.shape([96]))
            both = R.sum(R.concat([R.multiply(dy, xhat), dy], axis=2), axis=[0, 1])  # BSB's form
            rows = R.sum(dy, axis=[2])  # a row reduction: not this rule's
            out = (db, both, rows)
            R.output(out)
        return out


def test_column_reductions_are_scheduled_and_exact():
    mod = _lowered(BiasAndScaleGradients)
    kinds = {gv.name_hint: is_column_reduction(f) for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    scheduled, done = apply_reduction_schedules(mod)
    assert sorted(done) == sorted(name for name, col in kinds.items() if col)
    assert len(done) >= 2 and not all(kinds.values())  # the row sum is left to the default schedule
    from schedules.default import apply_default_schedules

    target = tvm.target.Target({"kind": "llvm"})
    vm = relax.VirtualMachine(relax.build(apply_default_schedules(scheduled, target), target=target), tvm.cpu())
    rng = np.random.default_rng(0)
    dy, xhat = (rng.standard_normal((4, 8, 96)).astype(np.float32) for _ in range(2))
    db, both, rows = (t.numpy() for t in vm["main"](tvm.runtime.tensor(dy), tvm.runtime.tensor(xhat)))
    np.testing.assert_allclose(db, dy.sum((0, 1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(both, np.concatenate([dy * xhat, dy], 2).sum((0, 1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rows, dy.sum(2), rtol=1e-5, atol=1e-5)


def test_tuner_leaves_column_reductions_out(tiny_layer):
    from schedules.tune import extract_tasks

    tasks, _ = extract_tasks(tiny_layer, "llvm", {"hidden_states": [2, 8, 32], "attention_mask": [2, 8]}, train=True)
    names = [t.task_name for t in tasks]
    assert names and not [n for n in names if "collapse_sum" in n]
    assert not [t for t in tasks if is_column_reduction(t.dispatched[0]["main"])]
