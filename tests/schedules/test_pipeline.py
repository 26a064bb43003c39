"""The schedule stage as one pass: rules in declared order, each kernel to the first rule that takes it."""
import tvm
from tvm import te

from schedules.default import DefaultSchedule
from schedules.logs import TuningRecords
from schedules.pipeline import SCHEDULE_RULES, apply_schedules, hand_kernels, scheduled_by, tuned_kernels
from schedules.rule import RULE_ATTR, ScheduleRule, is_scheduled
from tvmdm.core.options import Options


def _kernel(name):
    a = te.placeholder((8,), name="a")
    return te.create_prim_func([a, te.compute((8,), lambda i: a[i] + 1, name=name)])


def _module():
    return tvm.IRModule({"add_a": _kernel("a"), "add_b": _kernel("b")})


class Takes(ScheduleRule):
    """Takes the kernels named in ``names``; raises (a loop nest it cannot transform) on ``breaks``."""

    def __init__(self, name, names, breaks=()):
        self.name, self.names, self.breaks = name, set(names), set(breaks)

    def schedule(self, func, options):
        symbol = str(func.attrs["global_symbol"])
        if symbol in self.breaks:
            raise tvm.error.InternalError("the rule does not fit this loop nest")
        return func.with_attr("tirx.is_scheduled", True) if symbol in self.names else None


def test_each_kernel_goes_to_the_first_rule_that_takes_it():
    options = Options(tvm.target.Target({"kind": "llvm"}))
    rules = [Takes("first", ["add_a"], breaks=["add_b"]), Takes("second", ["add_a", "add_b"]), DefaultSchedule()]
    out = apply_schedules(options, rules)(_module())
    assert scheduled_by(out, rules[0]) == ["add_a"] and scheduled_by(out, rules[1]) == ["add_b"]
    assert all(is_scheduled(f) for f in out.functions.values())
    assert {str(f.attrs[RULE_ATTR]) for f in out.functions.values()} == {"first", "second"}


def test_the_default_rule_takes_what_no_rule_took():
    options = Options(tvm.target.Target({"kind": "llvm"}))
    out = apply_schedules(options, [Takes("none", []), DefaultSchedule()])(_module())
    assert scheduled_by(out, DefaultSchedule()) == ["add_a", "add_b"]
    assert hand_kernels(out) == [] and tuned_kernels(out) == []


def test_declared_order_hand_written_rules_first_then_the_records_that_apply():
    names = [rule.name for rule in SCHEDULE_RULES]
    assert names == ["column reductions", "transposes", "packed contractions", "int8 contractions", "amx contractions",
                     "amx attention", "bf16 contractions", "attention", "row normalizations", "tuning records", "tuning records",
                     "default"]
    early, late = (r for r in SCHEDULE_RULES if isinstance(r, TuningRecords))
    target = tvm.target.Target({"kind": "llvm"})
    tuned_here = Options(target, tuning_logs=("logs",))  # contractions not packed: the records were tuned here
    elsewhere = Options(target, tuning_logs=("logs",), packed_lanes=48)
    assert tuned_here.records_first and not elsewhere.records_first
    kernels = {tvm.ir.GlobalVar("k"): _kernel("k")}
    assert early.apply(kernels, elsewhere) == {} and late.apply(kernels, tuned_here) == {}
