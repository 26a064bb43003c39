"""Options: one set of choices per compile, checked where it is made."""
import pytest
import tvm

from tvmdm.build.options import make_options
from tvmdm.core.options import DEFAULT_FUSION, Options, layout_name, parse_layout

LLVM = tvm.target.Target({"kind": "llvm"})


@pytest.mark.parametrize("field, value, message", [
    ("fusion", "fast", "unknown fusion level 'fast'"),
    ("layout", "sbhd", "unknown attention layout 'sbhd'"),
    ("precision", "int4", "unknown precision 'int4'"),
    ("precision", "fp16", "precision='fp16' is built for cuda targets, not llvm"),
])
def test_bad_settings_are_refused_with_the_rule(field, value, message):
    with pytest.raises(ValueError, match=message):
        Options(LLVM, **{field: value})


def test_defaults_and_layout_names():
    options = Options(LLVM)
    assert options.fusion == DEFAULT_FUSION == "paper" and options.layout == "bshd" and options.on_cpu
    assert parse_layout("qkv=bhsd,ctx=bshd") == {"qkv": "bhsd", "ctx": "bshd"}
    assert layout_name("bhsd", "bshd") == "qkv=bhsd,ctx=bshd" and layout_name("bshd", "bshd") == "bshd"
    assert options.replace(fusion="tvm").fusion == "tvm" and options.fusion == "paper"


def test_make_options_resolves_logs_and_packing(tmp_path):
    user_logs = tmp_path / "mine"
    user_logs.mkdir()
    # a user's own log directory: its records are trusted (tuned here), nothing is packed
    mine = make_options("llvm", tuning_logs=str(user_logs))
    assert mine.tuning_logs == (str(user_logs),) and mine.packed_lanes is None and mine.records_first
    # no logs at all: the plain default schedules, nothing packed
    none = make_options("llvm", tuning_logs=None)
    assert none.tuning_logs == () and none.packed_lanes is None
    # an empty list (no shipped log suits this CPU): fp32 contractions packed, records (none) come last
    packed = make_options("llvm", tuning_logs=[])
    assert packed.packed_lanes in (24, 48) and not packed.records_first
    assert make_options("llvm", tuning_logs=[], precision="bf16").packed_lanes is None  # bf16 has its own kernel


def test_shipped_records_serve_the_size_they_were_tuned_at_and_other_sizes_get_packed_contractions():
    from schedules.logs import token_rows
    from tests.helpers.cpu_kinds import BY_NAME

    zen4 = BY_NAME["zen4"].target()  # the shipped logs were tuned on a Zen 4 at (8, 128): 1024 rows
    assert token_rows([[8, 128, 768], [8, 128]]) == token_rows([[8, 128]]) == 1024
    assert token_rows([["batch", 128]]) is None
    assert make_options(zen4, rows=1024).packed_lanes is None  # the records' contractions
    assert make_options(zen4, rows=None).packed_lanes is None
    # (1, 128): no record of its contractions; the micro-kernel instead of the default schedule (3x slower)
    assert make_options(zen4, rows=128).packed_lanes == 48
