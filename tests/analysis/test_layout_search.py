"""The global layout selection (tvmdm.layout_search) on synthetic cost tables, where the answer is known."""
import itertools

import pytest

from tvmdm.analysis.layout_search import Config, Operator, select_layouts


def _brute_force(operators, transpose, inputs, outputs, shared):
    best = None
    for choice in itertools.product(*[op.configs for op in operators]):
        layouts = {}
        if any(len({c.layouts[t] for op, c in zip(operators, choice) for t in (*op.reads, *op.writes)
                    if t in group}) > 1 for group in shared):
            continue
        held = {t: {l} for t, l in inputs.items()}
        cost = 0.0
        for op, c in zip(operators, choice):
            cost += c.seconds
            for t in op.reads:
                if c.layouts[t] not in held[t]:
                    cost += transpose(t, sorted(held[t])[0], c.layouts[t])
                    held[t].add(c.layouts[t])
            for t in op.writes:
                held[t] = {c.layouts[t]}
        for t, l in outputs.items():
            if l not in held[t]:
                cost += transpose(t, sorted(held[t])[0], l)
        if best is None or cost < best[0]:
            best = (cost, {op.name: c.name for op, c in zip(operators, choice)})
        del layouts
    return best


def _attention(costs):
    """proj -> q,k,v ; scores(q,k) -> p ; context(p, v) -> ctx ; out(ctx). costs: (op, config) -> seconds."""
    def cfg(op, name, **layouts):
        return Config(name, layouts, costs[(op, name)])

    return [
        Operator("proj", ("x",), ("q", "k", "v"), (cfg("proj", "bshd", x="bsH", q="bshd", k="bshd", v="bshd"),)),
        Operator("scores", ("q", "k"), ("p",), tuple(cfg("scores", l, q=l, k=l, p="bhqk") for l in ("bshd", "bhsd"))),
        Operator("context", ("p", "v"), ("ctx",), tuple(
            cfg("context", f"{lv}->{lc}", p="bhqk", v=lv, ctx=lc)
            for lv in ("bshd", "bhsd") for lc in ("bshd", "bhsd"))),
        Operator("out", ("ctx",), ("y",), (cfg("out", "bshd", ctx="bshd", y="bsH"),)),
    ]


BASE = {("proj", "bshd"): 10.0, ("scores", "bshd"): 3.0, ("scores", "bhsd"): 2.0,
        ("context", "bshd->bshd"): 3.0, ("context", "bshd->bhsd"): 2.5, ("context", "bhsd->bshd"): 2.0,
        ("context", "bhsd->bhsd"): 1.5, ("out", "bshd"): 10.0}


def test_picks_transposes_when_they_pay_and_not_when_they_do_not():
    # Cheap transposes: the faster head-major kernels win despite paying for them.
    cheap = select_layouts(_attention(BASE), lambda t, a, b: 0.1, inputs={"x": "bsH"}, outputs={"y": "bsH"})
    assert {op: c.name for op, c in cheap.configs.items()} == {
        "proj": "bshd", "scores": "bhsd", "context": "bhsd->bhsd", "out": "bshd"}
    assert sorted(t for t, *_ in cheap.transposes) == ["ctx", "k", "q", "v"]
    assert cheap.seconds == pytest.approx(10 + 2 + 1.5 + 10 + 0.4)
    # Dear transposes: everything stays where the projection wrote it.
    dear = select_layouts(_attention(BASE), lambda t, a, b: 5.0, inputs={"x": "bsH"}, outputs={"y": "bsH"})
    assert {c.name for c in dear.configs.values()} == {"bshd", "bshd->bshd"}
    assert dear.transposes == [] and dear.seconds == pytest.approx(26.0)


def test_shared_group_forces_one_layout_for_q_k_v():
    costs = dict(BASE)
    transpose = lambda t, a, b: {"q": 0.1, "k": 0.1, "v": 9.0, "ctx": 9.0}[t]  # noqa: E731
    free = select_layouts(_attention(costs), transpose, inputs={"x": "bsH"}, outputs={"y": "bsH"})
    assert free.configs["scores"].name == "bhsd" and free.configs["context"].layouts["v"] == "bshd"
    tied = select_layouts(_attention(costs), transpose, inputs={"x": "bsH"}, outputs={"y": "bsH"},
                          shared=[("q", "k", "v")])
    assert tied.configs["scores"].layouts["q"] == tied.configs["context"].layouts["v"]
    assert tied.seconds >= free.seconds


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force_on_random_tables(seed):
    import random

    rng = random.Random(seed)
    costs = {k: rng.uniform(0.5, 5.0) for k in BASE}
    t_costs = {t: rng.uniform(0.0, 3.0) for t in ("q", "k", "v", "ctx", "y")}
    transpose = lambda t, a, b: t_costs[t]  # noqa: E731
    shared = [("q", "k")] if seed % 2 else []
    ops = _attention(costs)
    got = select_layouts(ops, transpose, inputs={"x": "bsH"}, outputs={"y": "bsH"}, shared=shared)
    want_cost, want = _brute_force(ops, transpose, {"x": "bsH"}, {"y": "bsH"}, shared)
    assert got.seconds == pytest.approx(want_cost)
    got_total = sum(c.seconds for c in got.configs.values()) + sum(s for *_, s in got.transposes)
    assert got_total == pytest.approx(got.seconds)


def test_output_layout_is_honoured():
    ops = [Operator("f", ("x",), ("y",), (Config("a", {"x": "A", "y": "A"}, 1.0),
                                          Config("b", {"x": "A", "y": "B"}, 0.5)))]
    sel = select_layouts(ops, lambda t, a, b: 1.0, inputs={"x": "A"}, outputs={"y": "A"})
    assert sel.configs["f"].name == "a" and sel.seconds == pytest.approx(1.0)
    sel = select_layouts(ops, lambda t, a, b: 0.1, inputs={"x": "A"}, outputs={"y": "A"})
    assert sel.configs["f"].name == "b" and sel.transposes == [("y", "B", "A", 0.1)]


def test_errors_name_the_operator():
    ops = [Operator("f", ("x",), ("y",), (Config("a", {"x": "A"}, 1.0),))]
    with pytest.raises(ValueError, match="operator f config a: no layout for \\['y'\\]"):
        select_layouts(ops, lambda t, a, b: 0.0, inputs={"x": "A"})
    ops = [Operator("f", ("z",), ("y",), (Config("a", {"z": "A", "y": "A"}, 1.0),))]
    with pytest.raises(ValueError, match="operator f reads 'z'"):
        select_layouts(ops, lambda t, a, b: 0.0, inputs={"x": "A"})
