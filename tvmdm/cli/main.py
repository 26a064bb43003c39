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
from tvmdm.core.errors import TvmdmError
from tvmdm.core.options import DEFAULT_FUSION, DEFAULT_LAYOUT, FUSION_LEVELS
from tvmdm.core.precision import PRECISIONS

ARTIFACT_SUFFIX = ".tvmdm"


def _parse_shape(text: str) -> tuple[str, list[int]]:
    """'input_ids=8x128' -> ('input_ids', [8, 128])"""
    name, sep, dims = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, [int(d) for d in dims.replace(",", "x").split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad --shape {text!r}: expected NAME=D0xD1x..., e.g. input_ids=8x128")


def _logs(args):
    """--logs DIR (repeatable) -> tuning_logs=: the shipped logs when not given, none for 'none'."""
    if not args.logs:
        return "shipped"
    return None if args.logs == ["none"] else list(args.logs)


def _compile(args):
    import tvmdm

    shapes = resolve_shapes(args.model, args.shape, args.batch, args.seq, embedded_defaults=False)
    return tvmdm.compile(model_or_path(args.model), target=args.target, shapes=shapes, fusion=args.fusion,
                         layout=args.layout, precision=args.precision, tuning_logs=_logs(args))


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
    parser.add_argument("--trials", type=_positive_int, default=64, help="total trials wanted in the log (default 64)")
    parser.add_argument("--per-iter", type=_positive_int, default=8, help="trials per task per round (default 8)")
    parser.add_argument("--shape", action="append", default=[], type=_parse_shape, metavar="NAME=D0xD1",
                        help="bind an input shape")
    _add_batch_seq(parser, "the embedded model's")
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


def _positive_int(text: str) -> int:
    """A size (--batch, --seq, --steps, --trials...): a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def cmd_bench(args) -> int:
    from tvmdm.bench.inference import run_bench

    model = args.model
    if args.train:
        from tvmdm.bench.training import run_train_bench

        run_train_bench(model, batch=args.batch, seq=args.seq, target=args.target, min_runs=args.min_runs,
                        max_seconds=args.max_seconds, torch=not args.no_torch,
                        torch_compile=not args.no_torch_compile, json_path=args.json, plot_path=args.plot,
                        precisions=args.precision.split(","), fusions=args.fusion.split(","),
                        tuning_logs=_logs(args))
        return 0
    scan = None
    if args.scan or args.scan_seq or args.scan_batch:
        scan = {"seq": args.scan_seq or [64, 128, 256, 512], "batch": args.scan_batch or [1, 8, 32]}
    run_bench(model, batch=args.batch, seq=args.seq, target=args.target, min_runs=args.min_runs,
              max_seconds=args.max_seconds, untuned=args.untuned, fusion_levels=args.fusion.split(","),
              precisions=args.precision.split(","), ort_optimized=not args.no_ort_opt, torch=not args.no_torch, torch_compile=not args.no_torch_compile,
              kernels=not args.no_kernels, scan=scan, json_path=args.json, plot_path=args.plot,
              tuning_logs=_logs(args), symbolic=args.symbolic)
    return 0


def cmd_analyze(args) -> int:
    from tvmdm.analysis import report as A

    shapes = resolve_shapes(args.model, args.shape, args.batch, args.seq)
    model = model_or_path(args.model)
    reports = [A.analyze(model, fusion=f, shapes=shapes, measure=args.measure, layout=args.layout,
                         tuning_logs=_logs(args))
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
                       tuning_logs=_logs(args))
    return 0 if np.isfinite(losses).all() else 1


def cmd_demo(args) -> int:
    from tvmdm.cli.demo import run_demo

    return run_demo(args.model, batch=args.batch, seq=args.seq, target=args.target, tuning_logs=_logs(args))


def _add_batch_seq(p: argparse.ArgumentParser, default: str) -> None:
    """--batch / --seq mean one thing in every command: the (batch, seq) the model is compiled (bound) and run at."""
    p.add_argument("--batch", type=_positive_int, help=f"bind every input's batch dim (default: {default})")
    p.add_argument("--seq", type=_positive_int, help=f"bind every input's sequence dim (default: {default})")


def _add_logs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--logs", action="append", metavar="DIR", help="tuning log directory to apply (repeatable; "
                   "what `tvmdm tune --logs DIR` wrote); default: the shipped logs for the target; 'none': "
                   "default schedules only")


def _add_compile_options(p: argparse.ArgumentParser, default_size: str) -> None:
    p.add_argument("--target", default="llvm", help="llvm (this CPU), cuda or cuda:sm_80 (default: llvm)")
    _add_batch_seq(p, default_size)
    p.add_argument("--shape", action="append", type=_parse_shape, metavar="NAME=D0xD1",
                   help="bind an input's shape (repeatable); unbound dims stay symbolic")
    _add_logs(p)
    p.add_argument("--fusion", default=DEFAULT_FUSION, choices=list(FUSION_LEVELS),
                   help=f"fusion level (default: {DEFAULT_FUSION})")
    p.add_argument("--layout", default=DEFAULT_LAYOUT, help="attention layout under --fusion paper (default: bshd)")
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                   help="bf16: weight contractions in bf16 with fp32 accumulation (AMX tiles where the CPU has them)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tvmdm", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("-v", "--verbose", action="store_true", help="show TVM's own log lines (C++ warnings, "
                        "MetaSchedule) and tvmdm's debug log; TVMDM_VERBOSE=1 prints TVM's as it writes them")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="compile an ONNX model (or a default model name) into an artifact")
    p.add_argument("model", help="ONNX file, or one of the embedded models (bert-base-layer, bert-small, ...)")
    p.add_argument("-o", "--output", help=f"artifact path (default: MODEL{ARTIFACT_SUFFIX})")
    _add_compile_options(p, "symbolic: one artifact for every size")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("run", help="run an artifact or ONNX model on given or synthetic inputs")
    p.add_argument("model", help=f"artifact (*{ARTIFACT_SUFFIX}), ONNX file or embedded model name")
    p.add_argument("--inputs", help="npz file of inputs (default: synthetic inputs of --batch x --seq)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", "-o", help="write outputs to this npz file")
    p.add_argument("--check", action="store_true", help="compare against onnxruntime (ONNX models only)")
    _add_compile_options(p, "symbolic; synthetic inputs of 2 x 8")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("tune", help="tune the model's kernels with MetaSchedule into a log directory")
    _add_tune_options(p)
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("bench", help="tvmdm vs onnxruntime (plain, BERT-optimized) and PyTorch, same threads")
    p.add_argument("model", nargs="?", default="bert-base-layer", help="ONNX file or embedded model name")
    _add_batch_seq(p, "the embedded model's")
    p.add_argument("--symbolic", action="store_true", help="compile tvmdm with symbolic batch and seq (one "
                   "module for every size) and time it at --batch x --seq")
    p.add_argument("--target", default="llvm", help="llvm, or cuda on a machine with a GPU")
    _add_logs(p)
    p.add_argument("--fusion", default=DEFAULT_FUSION, help="comma-separated fusion levels to time (first is 'tvmdm')")
    p.add_argument("--untuned", action="store_true", help="also time tvmdm without tuning logs")
    p.add_argument("--precision", default="fp32", help="comma-separated precisions; each besides fp32 adds a "
                   "system (tvmdm[bf16]: bf16 contractions, checked to 1e-2 relative error; int8: the model through "
                   "onnxruntime's quantize_dynamic, run by tvmdm, onnxruntime and PyTorch's dynamic quantization, "
                   "checked to 1e-1)")
    p.add_argument("--train", action="store_true", help="time one training step (forward, loss, backward, AdamW) "
                   "against PyTorch eager and torch.compile instead of inference")
    p.add_argument("--min-runs", type=_positive_int, default=5, help="timed runs per round; rounds go on until the median "
                   "moves < 2%% (default 5)")
    p.add_argument("--max-seconds", type=float, default=30.0, help="time limit per system (default 30)")
    p.add_argument("--no-ort-opt", action="store_true", help="skip onnxruntime.transformers' BERT optimizer")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch")
    p.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile (slow to compile)")
    p.add_argument("--no-kernels", action="store_true", help="skip the per-kernel table")
    p.add_argument("--scan", action="store_true", help="also sweep seq 64..512 and batch 1..32")
    p.add_argument("--scan-seq", type=_int_list, help="seq values to sweep, e.g. 64,128,256")
    p.add_argument("--scan-batch", type=_int_list, help="batch values to sweep, e.g. 1,8,32")
    p.add_argument("--json", help="write the results (with machine info) as JSON")
    p.add_argument("--plot", help="write a bar plot (and the scan) as PNG")
    p.set_defaults(func=cmd_bench)

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
    p.add_argument("--shape", action="append", type=_parse_shape, metavar="NAME=D0xD1")
    _add_batch_seq(p, "the embedded model's; a file's dims stay symbolic")
    _add_logs(p)
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("train", help="train a BERT classifier on a synthetic task with the compiled training step")
    p.add_argument("model", nargs="?", help="ONNX sequence-classification export (default: the embedded "
                   "bert-small with a classifier head)")
    p.add_argument("--steps", type=_positive_int, default=50, help="training steps (default 50)")
    p.add_argument("--batch", type=_positive_int, default=8, help="bind every input's batch dim (default 8)")
    p.add_argument("--seq", type=_positive_int, default=32, help="bind every input's sequence dim (default 32)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data and the dropout masks")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability (default 0)")
    p.add_argument("--checkpoint", choices=["attention", "layer"], help="recompute these regions in backward")
    p.add_argument("--target", default="llvm")
    p.add_argument("--plot", default="train_loss.png", help="loss curve PNG (default train_loss.png; '' for none)")
    p.add_argument("--json", help="write the losses as JSON")
    p.add_argument("--export", help="write the trained step (weights + optimizer state) for load_train_step")
    _add_logs(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("demo", help="compile an embedded BERT model, run it and check it against onnxruntime")
    p.add_argument("model", nargs="?", default="bert-base-layer", help="embedded model name (default: "
                   "bert-base-layer)")
    _add_batch_seq(p, "the embedded model's, 8 x 128 for bert-base-layer")
    p.add_argument("--target", default="llvm")
    _add_logs(p)
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
