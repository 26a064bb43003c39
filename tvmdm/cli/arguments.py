"""The command line's shared arguments: sizes, shapes, tuning logs and the compile options."""
from __future__ import annotations

import argparse

from tvmdm.core.options import DEFAULT_FUSION, DEFAULT_LAYOUT, FUSION_LEVELS
from tvmdm.core.precision import PRECISIONS


def parse_shape(text: str) -> tuple[str, list[int]]:
    """'input_ids=8x128' -> ('input_ids', [8, 128])"""
    name, sep, dims = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, [int(d) for d in dims.replace(",", "x").split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad --shape {text!r}: expected NAME=D0xD1x..., e.g. input_ids=8x128")


def tuning_logs_option(args):
    """--logs DIR (repeatable) -> tuning_logs=: the shipped logs when not given, none for 'none'."""
    if not args.logs:
        return "shipped"
    return None if args.logs == ["none"] else list(args.logs)


def positive_int(text: str) -> int:
    """A size (--batch, --seq, --steps, --trials...): a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def add_batch_seq(p: argparse.ArgumentParser, default: str) -> None:
    """--batch / --seq mean one thing in every command: the (batch, seq) the model is compiled (bound) and run at."""
    p.add_argument("--batch", type=positive_int, help=f"bind every input's batch dim (default: {default})")
    p.add_argument("--seq", type=positive_int, help=f"bind every input's sequence dim (default: {default})")


def add_logs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--logs", action="append", metavar="DIR", help="tuning log directory to apply (repeatable; "
                   "what `tvmdm tune --logs DIR` wrote); default: the shipped logs for the target; 'none': "
                   "default schedules only")


def add_compile_options(p: argparse.ArgumentParser, default_size: str) -> None:
    p.add_argument("--target", default="llvm", help="llvm (this CPU), cuda or cuda:sm_80 (default: llvm)")
    add_batch_seq(p, default_size)
    p.add_argument("--shape", action="append", type=parse_shape, metavar="NAME=D0xD1",
                   help="bind an input's shape (repeatable); unbound dims stay symbolic")
    add_logs(p)
    p.add_argument("--fusion", default=DEFAULT_FUSION, choices=list(FUSION_LEVELS),
                   help=f"fusion level (default: {DEFAULT_FUSION})")
    p.add_argument("--layout", default=DEFAULT_LAYOUT, help="attention layout under --fusion paper (default: bshd)")
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                   help="bf16: weight contractions in bf16 with fp32 accumulation (AMX tiles where the CPU has them)")
