"""The dependency rule of the README's architecture section, read off the import graph.

Stages, lowest first; a module may import its own stage and the stages below it, never one above nor one
beside it in the same row. Only the top rows (benchmarks and the CLI) use the public API (``import tvmdm``);
nothing imports the CLI; no module is over ~400 lines.
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = [
    ("tvmdm.core", "tuning_logs"),
    ("tvmdm.models", "tvmdm.runtime"),
    ("onnx_import",),
    ("tvmdm.transform",),
    ("schedules",),
    ("tvmdm.build",),
    ("tvmdm.train",),
    ("tvmdm.analysis", "tvmdm.tune"),
    ("tvmdm.bench",),
    ("tvmdm.cli",),
]
API_USERS = ("tvmdm.bench", "tvmdm.cli")
RANK = {stage: rank for rank, row in enumerate(STAGES) for stage in row}
PACKAGES = ("tvmdm", "schedules", "onnx_import", "tuning_logs")
MAX_LINES = 420


def _modules() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    found[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return found


MODULES = _modules()


def _imports(path: str) -> set[str]:
    """Every project module ``path`` imports, at the top or inside a function (``from pkg import sub``
    counts as importing ``pkg.sub`` where that is a module)."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & set(MODULES)
            names.update(submodules)
            if len(submodules) < len(node.names):  # names defined in the module itself
                names.add(node.module)
    return {n for n in names if n.split(".")[0] in PACKAGES}


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def stage_of(module: str) -> str | None:
    return next((s for s in sorted(RANK, key=len, reverse=True) if module == s or module.startswith(s + ".")), None)


def test_every_module_belongs_to_a_stage():
    assert sorted(m for m in MODULES if stage_of(m) is None and m not in ("tvmdm", "tvmdm.__main__")) == []


def test_stages_import_only_their_own_and_lower_stages():
    wrong = []
    for module, imported in GRAPH.items():
        here = stage_of(module)
        if here is None:
            continue
        for name in imported:
            there = stage_of(name)
            if name == "tvmdm":
                if here not in API_USERS:
                    wrong.append(f"{module} imports the public API (tvmdm)")
            elif there != here and (there is None or RANK[there] >= RANK[here]):
                wrong.append(f"{module} ({here}) imports {name} ({there})")
    assert wrong == []


def test_nothing_imports_the_cli():
    users = sorted(m for m, imported in GRAPH.items() if stage_of(m) != "tvmdm.cli" and m != "tvmdm.__main__"
                   and any(stage_of(n) == "tvmdm.cli" for n in imported))
    assert users == []


def test_no_import_cycle_between_modules():
    state, cycles = {}, []

    def visit(module, path):
        state[module] = "open"
        for name in GRAPH.get(module, ()):
            if name not in GRAPH or name == "tvmdm":
                continue
            if state.get(name) == "open":
                cycles.append(path[path.index(name):] + [name])
            elif name not in state:
                visit(name, path + [name])
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module):
    assert sum(1 for _ in open(MODULES[module])) <= MAX_LINES


def test_the_rule_catches_an_upward_import(tmp_path):
    """The checks above are not vacuous: a schedule importing the build stage is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from tvmdm.build.pipeline import build\n")
    assert "tvmdm.build.pipeline" in _imports(str(bad))
    assert RANK[stage_of("tvmdm.build.pipeline")] > RANK[stage_of("schedules.rule")]
