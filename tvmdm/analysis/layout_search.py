"""Global data-layout selection, the paper's way: a shortest path over (operator, configuration) choices.

Each operator has candidate configurations: the layout it reads each input in, the layout it writes each
output in, and its measured time in that configuration. When an operator reads a tensor in a layout the
tensor is not held in, a transpose is paid (once: later readers reuse the transposed copy). Layouts named in
a ``shared`` group must be equal (e.g. Q and K, read by one contraction). The search is Dijkstra over states
(operator index, layouts held for every tensor still to be read, choices of the shared groups): exact, and
small for a transformer layer's handful of operators and two or three layouts per tensor.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Callable, Mapping, Sequence

import numpy as np


SINK = "<graph outputs>"


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    layouts: Mapping[str, str]  # tensor -> layout, for every tensor the operator reads or writes
    seconds: float


@dataclasses.dataclass(frozen=True)
class Operator:
    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    configs: tuple[Config, ...]


@dataclasses.dataclass
class Selection:
    configs: dict[str, Config]  # operator -> chosen configuration
    transposes: list[tuple[str, str, str, float]]  # (tensor, from layout, to layout, seconds)
    seconds: float  # operators + transposes

    def table(self) -> str:
        rows = [f"  {op}: {c.name} ({c.seconds * 1e3:.3f} ms)" for op, c in self.configs.items()]
        rows += [f"  transpose {t}: {a} -> {b} ({s * 1e3:.3f} ms)" for t, a, b, s in self.transposes]
        return "\n".join(rows + [f"  total {self.seconds * 1e3:.3f} ms"])


def select_layouts(operators: Sequence[Operator], transpose_seconds: Callable[[str, str, str], float], *,
                   inputs: Mapping[str, str] | None = None, outputs: Mapping[str, str] | None = None,
                   shared: Sequence[Sequence[str]] = ()) -> Selection:
    """Cheapest configuration of every operator (in the given, topological, order).

    inputs: graph inputs -> the layout they arrive in; outputs: graph outputs -> the layout they must leave in;
    transpose_seconds(tensor, from, to): cost of one layout change of that tensor."""
    inputs, outputs = dict(inputs or {}), dict(outputs or {})
    if outputs:  # a sink that reads every output in its required layout: its transposes are on the path
        operators = [*operators, Operator(SINK, tuple(outputs), (), (Config("required", outputs, 0.0),))]
    group_of = {t: g for g, tensors in enumerate(shared) for t in tensors}
    last_read = {}
    for i, op in enumerate(operators):
        for t in op.reads:
            last_read[t] = i
    for op in operators:
        for c in op.configs:
            missing = set(op.reads) | set(op.writes)
            missing -= set(c.layouts)
            if missing:
                raise ValueError(f"operator {op.name} config {c.name}: no layout for {sorted(missing)}")

    def live(held: dict, index: int) -> tuple:
        return tuple(sorted((t, frozenset(ls)) for t, ls in held.items() if last_read.get(t, -1) >= index))

    start_held = {t: {layout} for t, layout in inputs.items()}
    counter = itertools.count()  # tie-break so heap entries never compare dicts
    heap = [(0.0, next(counter), 0, start_held, {}, {}, [])]
    seen = set()
    while heap:
        cost, _, index, held, groups, chosen, transposes = heapq.heappop(heap)
        key = (index, live(held, index), tuple(sorted(groups.items())))
        if key in seen:
            continue
        seen.add(key)
        if index == len(operators):
            chosen.pop(SINK, None)
            return Selection(chosen, transposes, cost)
        op = operators[index]
        for config in op.configs:
            step_groups = dict(groups)
            if not _consistent(op, config, group_of, step_groups):
                continue
            new_held = {t: set(ls) for t, ls in held.items()}
            step_cost, step_transposes = config.seconds, []
            for t in op.reads:
                want = config.layouts[t]
                if t not in new_held:
                    raise ValueError(f"operator {op.name} reads {t!r}, which no earlier operator or input makes")
                if want not in new_held[t]:
                    source = sorted(new_held[t])[0]
                    s = transpose_seconds(t, source, want)
                    step_cost += s
                    step_transposes.append((t, source, want, s))
                    new_held[t].add(want)
            for t in op.writes:
                new_held[t] = {config.layouts[t]}
            heapq.heappush(heap, (cost + step_cost, next(counter), index + 1, new_held, step_groups,
                                  {**chosen, op.name: config}, transposes + step_transposes))
    raise ValueError("no configuration satisfies the shared-layout constraints")


def _consistent(op: Operator, config: Config, group_of: dict, groups: dict) -> bool:
    """Record the layouts this config gives shared groups; False when it contradicts an earlier choice."""
    for t in (*op.reads, *op.writes):
        g = group_of.get(t)
        if g is None:
            continue
        layout = config.layouts[t]
        if groups.setdefault(g, layout) != layout:
            return False
    return True


# --- the attention's layouts, measured ----------------------------------------------------------------------

QKV, CTX = ("q", "k", "v"), "ctx"


@dataclasses.dataclass
class LayoutChoice:
    """What ``choose_attention_layout`` measured and picked."""

    layout: str  # for tvmdm.compile(layout=...)
    selection: Selection
    measured: dict[str, dict[str, float]]  # layout -> {"scores", "context", "qkv_transpose", "ctx_transpose"} s
    bytes_moved: dict[str, int]  # layout -> bytes moved by the layer's kernels (analysis)
    model_seconds: dict[str, float]  # layout -> median time of the whole compiled model (the check)

    def table(self) -> str:
        lines = ["| layout | scores ms | context ms | transposes ms | MB moved | whole model ms |",
                 "|---|---|---|---|---|---|"]
        for layout, m in self.measured.items():
            transposes = 3 * m.get("qkv_transpose", 0.0) + m.get("ctx_transpose", 0.0)
            lines.append(f"| {layout} | {m['scores'] * 1e3:.3f} | {m['context'] * 1e3:.3f} | "
                         f"{transposes * 1e3:.3f} | {self.bytes_moved[layout] / 1e6:.2f} | "
                         f"{self.model_seconds[layout] * 1e3:.2f} |")
        if all(m["context"] == 0.0 for m in self.measured.values()):
            lines.append("\n(SM and the context run as one kernel, tvmdm.transform.attention_kernel: the scores column "
                         "is its time)")
        return "\n".join(lines) + f"\n\nchosen: {self.layout}\n{self.selection.table()}\n"


def _layout_costs(compiled, target) -> dict[str, float]:
    """Times of the attention's kernels in one compiled layout: the scores (sm) and context kernels, and the
    transposes before sm (one per Q/K/V copy) and after the context kernel."""
    from tvmdm.transform.ir import op_name
    from tvmdm.analysis.profile import call_sites, time_kernel
    from tvmdm.transform.attention_kernel import ATTENTION_KERNEL

    order = list(call_sites(compiled.mod))
    costs: dict[str, float] = {}
    names = {op_name(k): k for k in order}
    if ATTENTION_KERNEL in names:  # SM and the context in one kernel (static inference): its time is the scores'
        sm_at = ctx_at = order.index(names[ATTENTION_KERNEL])
        attention = {names[ATTENTION_KERNEL]: "scores"}
        costs["context"] = 0.0
    elif "sm" in names and "attention_context" in names:
        sm_at, ctx_at = order.index(names["sm"]), order.index(names["attention_context"])
        attention = {names["sm"]: "scores", names["attention_context"]: "context"}
    else:
        raise ValueError(f"{compiled.source}: no attention (sm and attention_context kernels) to choose layouts for")
    for i, kernel in enumerate(order):
        key = attention.get(kernel)
        if key is None and "transpose" in compiled.kernel_ops.get(kernel, []):
            key = "qkv_transpose" if i < sm_at else "ctx_transpose" if i > ctx_at else None
        if key is not None and key not in costs:
            costs[key] = time_kernel(compiled.mod[kernel], target)
    return costs


def choose_attention_layout(model, *, shapes: dict, tuning_logs="shipped", target="llvm") -> LayoutChoice:
    """Compile the model under every attention layout, time its attention kernels and transposes (tuned where
    the logs have them), and pick the cheapest global configuration by ``select_layouts``. Each kernel is
    timed alone, its inputs warm in cache (as MetaSchedule measures): a transpose looks cheaper than inside
    the model, so each layout's whole model is timed too and reported beside the choice."""
    from tvmdm.analysis.report import report_for
    from tvmdm.build.compiled import compile
    from tvmdm.core.options import LAYOUTS, layout_name, parse_layout
    from tvmdm.runtime.inputs import random_inputs

    measured, moved, whole = {}, {}, {}
    for layout in LAYOUTS:
        compiled = compile(model, shapes=shapes, fusion="paper", layout=layout, tuning_logs=tuning_logs,
                           target=target)
        measured[layout] = _layout_costs(compiled, compiled.target)
        whole[layout] = float(np.median(compiled.time(random_inputs(compiled), repeat=10)))
        moved[layout] = report_for(compiled.mod, compiled.kernel_ops, compiled.source, "paper",
                                   read_fractions=compiled.read_fractions).total_bytes
    scores_s: dict[str, float] = {}  # the same sm kernel was compiled twice per qkv layout: take the faster
    for lay, m in measured.items():
        q = parse_layout(lay)["qkv"]
        scores_s[q] = min(scores_s.get(q, m["scores"]), m["scores"])
    scores = tuple(Config(q, {"q": q, "k": q, "p": "bhqk"}, s) for q, s in scores_s.items())
    context = tuple(Config(lay, {"p": "bhqk", "v": parse_layout(lay)["qkv"], CTX: parse_layout(lay)["ctx"]},
                           m["context"]) for lay, m in measured.items())
    operators = [Operator("scores", ("q", "k"), ("p",), scores), Operator("context", ("p", "v"), (CTX,), context)]
    qkv_cost = max(m.get("qkv_transpose", 0.0) for m in measured.values())
    ctx_cost = max(m.get("ctx_transpose", 0.0) for m in measured.values())

    def transpose(tensor, _from, _to):
        return ctx_cost if tensor == CTX else qkv_cost

    selection = select_layouts(operators, transpose, inputs={t: "bshd" for t in QKV}, outputs={CTX: "bshd"},
                               shared=[QKV])
    chosen = layout_name(selection.configs["scores"].layouts["q"], selection.configs["context"].layouts[CTX])
    return LayoutChoice(chosen, selection, measured, moved, whole)
