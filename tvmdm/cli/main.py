"""The ``tvmdm`` command line: compile, run, tune, bench, analyze, train, demo.

Errors tvmdm raises on purpose are printed as one line naming what is wrong (exit 2); TVMDM_DEBUG=1
shows the traceback too.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from tvmdm.build.shapes import model_or_path, resolve_shapes
from tvmdm.cli.arguments import (add_batch_seq, add_compile_options, add_logs, parse_shape, positive_int,
                                 tuning_logs_option)
from tvmdm.cli.bench import add_bench_parser
from tvmdm.core.errors import TvmdmError
from tvmdm.core.options import DEFAULT_FUSION, DEFAULT_LAYOUT, FUSION_LEVELS

ARTIFACT_SUFFIX = ".tvmdm"


def _compile(args):
    import tvmdm

    shapes = resolve_shapes(args.model, args.shape, args.batch, args.seq, embedded_defaults=False)
    return tvmdm.compile(model_or_path(args.model), target=args.target, shapes=shapes, fusion=args.fusion,
                         layout=args.layout, precision=args.precision, tuning_logs=tuning_logs_option(args))


def cmd_compile(args) -> int:
    compiled = _compile(args)
    out = args.output or (os.path.splitext(os.path.basename(args.model))[0] + ARTIFACT_SUFFIX)
    compiled.export(out)
    print(f"compiled {compiled.source} for {args.target} ({', '.join(f'{k} {v:.1f}s' for k, v in compiled.timings.items())})")
    print(f"  kernels: {len(compiled.tuned_kernels)} from tuning logs, {len(compiled.hand_kernels)} by hand-written "
          f"schedules, {len(compiled.kernels)} in all")
    for kind, specs in (("input", compiled.inputs), ("output", compiled.outputs)):
        for s in specs:
            print(f"  {kind} {s.name}: {s.dtype}{list(s.shape)}")
    shared = compiled.imported.shared_initializers
    if shared:
        # Harmless for inference; in training these weights would be tied (one tensor, several layers).
        print(f"  {len(shared)} initializer(s) read by several nodes (de-duplicated by the exporter or shared "
              f"by design): " + "; ".join(f"{k} <- {', '.join(v[:3])}" for k, v in list(shared.items())[:5]))
    print(f"wrote {out}")
    return 0


def cmd_run(args) -> int:
    import tvmdm

    if args.model.endswith(ARTIFACT_SUFFIX):
        if args.check:
            raise TvmdmError("--check needs the ONNX model; an artifact carries no reference")
        runner = tvmdm.load(args.model)
    else:
        runner = _compile(args)
    if args.inputs:
        feeds = _load_inputs(args.inputs)
    else:
        feeds = tvmdm.random_inputs(runner, batch=args.batch or 2, seq=args.seq or 8, seed=args.seed)
    t0 = time.perf_counter()
    outputs = runner.run(feeds)
    elapsed = time.perf_counter() - t0
    for name, value in zip(runner.output_names, outputs):
        print(f"{name}: {value.dtype}{list(value.shape)} mean {value.mean():.6g} std {value.std():.6g}")
    print(f"ran in {elapsed * 1e3:.1f} ms")
    if args.output:
        np.savez(args.output, **dict(zip(runner.output_names, outputs)))
        print(f"wrote {args.output}")
    if args.check:
        result = runner.check(feeds)
        print(result)
        return 0 if result.ok else 1
    return 0


def _load_inputs(path: str) -> dict:
    """--inputs: an .npz of arrays named as the model's inputs (numpy.savez)."""
    from tvmdm.core.errors import InputError

    if not os.path.isfile(path):
        raise InputError(f"--inputs {path}: no such file")
    try:
        data = np.load(path, allow_pickle=False)
        if not hasattr(data, "files"):
            raise ValueError("one bare array (.npy), not named arrays")
        with data:
            return {k: data[k] for k in data.files}
    except (ValueError, OSError, EOFError) as err:
        raise InputError(f"--inputs {path}: not an .npz of named arrays (write one with numpy.savez(path, "
                         f"input_ids=..., ...)): {err}") from None


def cmd_tune(args) -> int:
    from tvmdm.tune.tuner import run_tuning

    shapes = resolve_shapes(args.model, args.shape, args.batch, args.seq)
    return run_tuning(model_or_path(args.model), logs=args.logs, target=args.target, trials=args.trials,
                      shapes=shapes, fusion=args.fusion, per_iter=args.per_iter, rpc_tracker=args.rpc_tracker,
                      rpc_key=args.rpc_key, name=args.model, train=args.train, only=args.only, layout=args.layout,
                      precision=args.precision, seconds=args.seconds)


def _add_tune_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="ONNX file or embedded model name (bert-base-layer, ...)")
    parser.add_argument("--logs", required=True, help="tuning log directory to write (a MetaSchedule JSON "
                        "database; a rerun continues it); compile, run, bench, analyze, train and demo read it "
                        "with --logs")
    parser.add_argument("--target", default="llvm", help="llvm, cuda or cuda:sm_80 (default llvm)")
    parser.add_argument("--trials", type=positive_int, default=64, help="total trials wanted in the log (default 64)")
    parser.add_argument("--per-iter", type=positive_int, default=8, help="trials per task per round (default 8)")
    parser.add_argument("--shape", action="append", default=[], type=parse_shape, metavar="NAME=D0xD1",
                        help="bind an input shape")
    add_batch_seq(parser, "the embedded model's")
    parser.add_argument("--fusion", default=DEFAULT_FUSION, choices=list(FUSION_LEVELS))
    parser.add_argument("--layout", default=DEFAULT_LAYOUT, help="attention layout under --fusion paper (see tvmdm.compile)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                        help="bf16: tune the kernels around the bf16 contractions (those have their own schedule)")
    parser.add_argument("--train", action="store_true", help="tune the kernels of the training step (forward, "
                        "MSE loss, backward, AdamW) instead of inference")
    parser.add_argument("--only", action="append", metavar="SUBSTRING", help="tune only the tasks whose name "
                        "contains this (repeatable), e.g. --only matmul")
    parser.add_argument("--seconds", type=float, help="stop after this many seconds (every measured batch is "
                        "kept; rerun to continue)")
    parser.add_argument("--rpc-tracker", metavar="HOST:PORT", help="measure on RPC servers through this tracker")
    parser.add_argument("--rpc-key", help="device key the RPC servers registered with")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from tvmdm import __version__

    try:
        tvm = version("apache-tvm")
    except PackageNotFoundError:
        tvm = "not installed"
    return f"tvmdm {__version__} (apache-tvm {tvm})"


def cmd_analyze(args) -> int:
    from tvmdm.analysis import report as A

    shapes = resolve_shapes(args.model, args.shape, args.batch, args.seq)
    model = model_or_path(args.model)
    reports = [A.analyze(model, fusion=f, shapes=shapes, measure=args.measure, layout=args.layout,
                         tuning_logs=tuning_logs_option(args))
               for f in args.fusion.split(",")]
    text = A.dump(reports, args.format)
    if args.layouts:
        from tvmdm.analysis.layout_search import choose_attention_layout

        choice = choose_attention_layout(model, shapes=shapes)
        text += "\n## attention layouts (paper fusion; kernels timed, transposes priced, shortest path)\n\n"
        text += choice.table()
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output}")
    else:
        print(text)
    if args.plot:
        from tvmdm.analysis.profile import gemm_peak_gflops

        peak = gemm_peak_gflops() if args.measure else None
        bandwidth = A.memory_bandwidth_gbs() if args.measure else None
        print(f"wrote {A.plot(reports, args.plot, peak, bandwidth)}")
    return 0


def cmd_train(args) -> int:
    from tvmdm.train.task import run_train

    losses = run_train(args.model, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, seed=args.seed,
                       target=args.target, plot=None if args.plot == "" else args.plot, json_path=args.json,
                       export=args.export, dropout=args.dropout, checkpoint=args.checkpoint or False,
                       tuning_logs=tuning_logs_option(args))
    return 0 if np.isfinite(losses).all() else 1


def cmd_demo(args) -> int:
    from tvmdm.cli.demo import run_demo

    return run_demo(args.model, batch=args.batch, seq=args.seq, target=args.target, tuning_logs=tuning_logs_option(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tvmdm", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("-v", "--verbose", action="store_true", help="show TVM's own log lines (C++ warnings, "
                        "MetaSchedule) and tvmdm's debug log; TVMDM_VERBOSE=1 prints TVM's as it writes them")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="compile an ONNX model (or a default model name) into an artifact")
    p.add_argument("model", help="ONNX file, or one of the embedded models (bert-base-layer, bert-small, ...)")
    p.add_argument("-o", "--output", help=f"artifact path (default: MODEL{ARTIFACT_SUFFIX})")
    add_compile_options(p, "symbolic: one artifact for every size")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("run", help="run an artifact or ONNX model on given or synthetic inputs")
    p.add_argument("model", help=f"artifact (*{ARTIFACT_SUFFIX}), ONNX file or embedded model name")
    p.add_argument("--inputs", help="npz file of inputs (default: synthetic inputs of --batch x --seq)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", "-o", help="write outputs to this npz file")
    p.add_argument("--check", action="store_true", help="compare against onnxruntime (ONNX models only)")
    add_compile_options(p, "symbolic; synthetic inputs of 2 x 8")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("tune", help="tune the model's kernels with MetaSchedule into a log directory")
    _add_tune_options(p)
    p.set_defaults(func=cmd_tune)

    add_bench_parser(sub)

    p = sub.add_parser("analyze", help="per-kernel flops / bytes / class report, fusion levels compared")
    p.add_argument("model", help="ONNX file or embedded model name")
    p.add_argument("--fusion", default="none,tvm,paper",
                   help="comma-separated fusion levels (first is the baseline)")
    p.add_argument("--layout", default=DEFAULT_LAYOUT, help="attention layout for fusion=paper (bshd, bhsd, "
                   "qkv=bshd,ctx=bhsd, qkv=bhsd,ctx=bshd)")
    p.add_argument("--layouts", action="store_true", help="time the attention under every layout and pick the "
                   "cheapest global configuration (the paper's shortest path)")
    p.add_argument("--format", default="md", choices=["md", "csv", "json"])
    p.add_argument("--output", "-o", help="write the report here instead of stdout")
    p.add_argument("--plot", help="write a roofline + bytes-by-class plot (PNG)")
    p.add_argument("--measure", action="store_true", help="time every kernel (static shapes; slow on big models)")
    p.add_argument("--shape", action="append", type=parse_shape, metavar="NAME=D0xD1")
    add_batch_seq(p, "the embedded model's; a file's dims stay symbolic")
    add_logs(p)
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("train", help="train a BERT classifier on a synthetic task with the compiled training step")
    p.add_argument("model", nargs="?", help="ONNX sequence-classification export (default: the embedded "
                   "bert-small with a classifier head)")
    p.add_argument("--steps", type=positive_int, default=50, help="training steps (default 50)")
    p.add_argument("--batch", type=positive_int, default=8, help="bind every input's batch dim (default 8)")
    p.add_argument("--seq", type=positive_int, default=32, help="bind every input's sequence dim (default 32)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data and the dropout masks")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability (default 0)")
    p.add_argument("--checkpoint", choices=["attention", "layer"], help="recompute these regions in backward")
    p.add_argument("--target", default="llvm")
    p.add_argument("--plot", default="train_loss.png", help="loss curve PNG (default train_loss.png; '' for none)")
    p.add_argument("--json", help="write the losses as JSON")
    p.add_argument("--export", help="write the trained step (weights + optimizer state) for load_train_step")
    add_logs(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("demo", help="compile an embedded BERT model, run it and check it against onnxruntime")
    p.add_argument("model", nargs="?", default="bert-base-layer", help="embedded model name (default: "
                   "bert-base-layer)")
    add_batch_seq(p, "the embedded model's, 8 x 128 for bert-base-layer")
    p.add_argument("--target", default="llvm")
    add_logs(p)
    p.set_defaults(func=cmd_demo)
    return parser


def _quiet_warnings(message, category, filename, lineno, line=None) -> str:
    """Warnings as one line each (the category and message), not Python's two with a source line."""
    return f"tvmdm: {category.__name__}: {message}\n"


def main(argv=None) -> int:
    import logging
    import warnings

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    warnings.formatwarning = _quiet_warnings
    try:
        return args.func(args)
    except (TvmdmError, KeyError, NotImplementedError, ValueError, OSError) as err:
        if os.environ.get("TVMDM_DEBUG"):
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        if isinstance(err, OSError) and err.filename:  # a file the command reads or writes: name it
            message = f"{err.filename}: {err.strerror or err}"
        print(f"tvmdm {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
