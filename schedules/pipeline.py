"""The schedule stage: one pass applying the rules in one declared order.

Each rule schedules the kernels it knows and returns nothing for the others; a kernel goes to the first rule
that takes it. The order says which schedule wins where several could:

  1-2  column reductions, transposes: by hand; MetaSchedule's CPU space finds nothing as good;
  3-6  packed fp32, int8 and bf16 contractions: the kernels the precision and quantization rewrites made for
       our micro-kernels (int8 on vpdpbusd; bf16 on the AMX tiles where the CPU has them and the shape fills
       whole tiles, else AVX512-BF16);
  7    tuning records, when they were tuned on this CPU model (``Options.records_first``);
  8-9  the paper's attention kernels and row-wise normalizations, by hand;
  10   tuning records otherwise (tuned on another CPU model: 5.5 ms for SM from the Zen 4 log on a Sapphire
       Rapids VM against 1.5 ms by hand, so they only fill in);
  11   the default schedule, for every kernel left.
"""
from __future__ import annotations

import tvm
from tvm import tirx

from schedules.amx import AmxContractions
from schedules.attention import AttentionKernels
from schedules.bf16 import Bf16Contractions
from schedules.default import DefaultSchedule
from schedules.int8 import Int8Contractions
from schedules.logs import TuningRecords
from schedules.packed import PackedContractions
from schedules.reductions import ColumnReductions
from schedules.rows import RowNormalizations
from schedules.rule import RULE_ATTR, is_scheduled, kernels_by
from schedules.transposes import Transposes

SCHEDULE_RULES = (
    ColumnReductions(),
    Transposes(),
    PackedContractions(),
    Int8Contractions(),
    AmxContractions(),
    Bf16Contractions(),
    TuningRecords(first=True),
    AttentionKernels(),
    RowNormalizations(),
    TuningRecords(first=False),
    DefaultSchedule(),
)


def apply_schedules(options, rules=SCHEDULE_RULES) -> tvm.transform.Pass:
    """Module pass: every unscheduled kernel of the module to the first of ``rules`` that takes it; each
    scheduled kernel carries the name of its rule (``RULE_ATTR``)."""

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.ApplySchedules")
    def run(mod, _ctx):
        mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for rule in rules:
            todo = {gv: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc) and not is_scheduled(f)}
            if not todo:
                break
            for gv, func in rule.apply(todo, options).items():
                mod[gv] = func.with_attr(RULE_ATTR, rule.name)
        return mod

    return run


def tuned_kernels(mod: tvm.IRModule) -> list[str]:
    """The kernels a tuning record scheduled."""
    return kernels_by(mod, hand_written=False, rules=[r for r in SCHEDULE_RULES if isinstance(r, TuningRecords)])


def hand_kernels(mod: tvm.IRModule) -> list[str]:
    """The kernels a hand-written rule scheduled."""
    return kernels_by(mod, hand_written=True, rules=SCHEDULE_RULES)


def scheduled_by(mod: tvm.IRModule, rule) -> list[str]:
    """The kernels ``rule`` (a ScheduleRule) scheduled."""
    return sorted(gv.name_hint for gv, f in mod.functions_items()
                  if isinstance(f, tirx.PrimFunc) and f.attrs and str(f.attrs.get(RULE_ATTR, "")) == rule.name)
