"""``tvmdm bench``: its arguments and the command (tvmdm.bench does the work)."""
from __future__ import annotations

from tvmdm.cli.arguments import add_batch_seq, add_logs, int_list, positive_int, tuning_logs_option
from tvmdm.core.options import DEFAULT_FUSION


def cmd_bench(args) -> int:
    if args.no_amx:
        from tvmdm.bench.without_amx import without_amx

        print("--no-amx: every system runs without the AMX tile units (tvmdm built for this CPU without them; "
              "onnxruntime's and PyTorch's processes refused the tile state)")
        with without_amx():
            return _bench(args)
    return _bench(args)


def _bench(args) -> int:
    from tvmdm.bench.inference import run_bench

    model = args.model
    if args.train:
        from tvmdm.bench.training import run_train_bench

        run_train_bench(model, batch=args.batch, seq=args.seq, target=args.target, min_runs=args.min_runs,
                        max_seconds=args.max_seconds, torch=not args.no_torch,
                        torch_compile=not args.no_torch_compile, json_path=args.json, plot_path=args.plot,
                        precisions=args.precision.split(","), fusions=args.fusion.split(","),
                        tuning_logs=tuning_logs_option(args))
        return 0
    scan = None
    if args.scan or args.scan_seq or args.scan_batch:
        scan = {"seq": args.scan_seq or [64, 128, 256, 512], "batch": args.scan_batch or [1, 8, 32]}
    run_bench(model, batch=args.batch, seq=args.seq, target=args.target, min_runs=args.min_runs,
              max_seconds=args.max_seconds, untuned=args.untuned, fusion_levels=args.fusion.split(","),
              precisions=args.precision.split(","), ort_optimized=not args.no_ort_opt, torch=not args.no_torch, torch_compile=not args.no_torch_compile,
              kernels=not args.no_kernels, scan=scan, json_path=args.json, plot_path=args.plot,
              tuning_logs=tuning_logs_option(args), symbolic=args.symbolic)
    return 0


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="tvmdm vs onnxruntime (plain, BERT-optimized) and PyTorch, same threads")
    p.add_argument("model", nargs="?", default="bert-base-layer", help="ONNX file or embedded model name")
    add_batch_seq(p, "the embedded model's")
    p.add_argument("--symbolic", action="store_true", help="compile tvmdm with symbolic batch and seq (one "
                   "module for every size) and time it at --batch x --seq")
    p.add_argument("--target", default="llvm", help="llvm, or cuda on a machine with a GPU")
    add_logs(p)
    p.add_argument("--fusion", default=DEFAULT_FUSION, help="comma-separated fusion levels to time (first is 'tvmdm')")
    p.add_argument("--untuned", action="store_true", help="also time tvmdm without tuning logs")
    p.add_argument("--precision", default="fp32", help="comma-separated precisions; each besides fp32 adds a "
                   "system (tvmdm[bf16]: bf16 contractions, checked to 1e-2 relative error; int8: the model through "
                   "onnxruntime's quantize_dynamic, run by tvmdm, onnxruntime and PyTorch's dynamic quantization, "
                   "checked to 1e-1)")
    p.add_argument("--train", action="store_true", help="time one training step (forward, loss, backward, AdamW) "
                   "against PyTorch eager and torch.compile instead of inference")
    p.add_argument("--min-runs", type=positive_int, default=5, help="timed runs per round; rounds go on until the median "
                   "moves < 2%% (default 5)")
    p.add_argument("--max-seconds", type=float, default=30.0, help="time limit per system (default 30)")
    p.add_argument("--no-ort-opt", action="store_true", help="skip onnxruntime.transformers' BERT optimizer")
    p.add_argument("--no-amx", action="store_true", help="run every system without the AMX tile units, as on a "
                   "CPU without them (Zen 4's AVX512-VNNI int8 and AVX512-BF16 paths, measured on a Sapphire Rapids "
                   "host; Linux x86-64)")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch")
    p.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile (slow to compile)")
    p.add_argument("--no-kernels", action="store_true", help="skip the per-kernel table")
    p.add_argument("--scan", action="store_true", help="also sweep seq 64..512 and batch 1..32")
    p.add_argument("--scan-seq", type=int_list, help="seq values to sweep, e.g. 64,128,256")
    p.add_argument("--scan-batch", type=int_list, help="batch values to sweep, e.g. 1,8,32")
    p.add_argument("--json", help="write the results (with machine info) as JSON")
    p.add_argument("--plot", help="write a bar plot (and the scan) as PNG")
    p.set_defaults(func=cmd_bench)
