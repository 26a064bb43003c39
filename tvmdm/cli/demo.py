"""The main job on the embedded default model: build it, compile it, run it, check it against onnxruntime."""
from __future__ import annotations

import time

import numpy as np


def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run_demo(name: str = "bert-base-layer", *, batch: int | None = None, seq: int | None = None,
             target: str = "llvm", tuning_logs="shipped") -> int:
    import tvmdm
    from tvmdm import models
    from tvmdm.build.check import compare_outputs, ort_session

    description, cfg = models.DEFAULT_MODELS[name] if name in models.DEFAULT_MODELS else (None, None)
    if cfg is None:
        raise KeyError(f"unknown default model {name!r}; choose one of {sorted(models.DEFAULT_MODELS)}")
    batch, seq = batch or cfg.batch, seq or cfg.seq
    print(f"tvmdm demo: {name} ({description}), batch {batch}, seq {seq}, target {target}")
    t0 = time.perf_counter()
    proto = tvmdm.default_model(name)
    build_s = time.perf_counter() - t0
    from tvmdm.build.shapes import resolve_shapes

    # Bind (batch, seq): the shipped tuning logs are for static shapes.
    compiled = tvmdm.compile(proto, target=target, shapes=resolve_shapes(name, None, batch, seq),
                             tuning_logs=tuning_logs)
    feeds = tvmdm.random_inputs(compiled, batch=batch, seq=seq)

    print(f"running tvmdm ({len(compiled.tuned_kernels)}/{len(compiled.kernels)} kernels from tuning logs, "
          f"{len(compiled.hand_kernels)} by hand-written schedules (the paper's attention and normalization "
          "kernels; the contractions too where no record is of this CPU model and size), the rest with default "
          "schedules) ...", flush=True)
    outputs = compiled.run(feeds)
    tvm_s = _median_seconds(lambda: compiled.run(feeds), repeat=5)
    sess = ort_session(proto)
    reference = sess.run(compiled.output_names, feeds)
    ort_s = _median_seconds(lambda: sess.run(compiled.output_names, feeds), repeat=5)
    result = compare_outputs(compiled.output_names, outputs, reference, atol=1e-4, rtol=1e-4)
    bf16_rows, bf16_ok = _bf16_rows(proto, name, batch, seq, target, feeds, reference, ort_s, tuning_logs)

    rows = [
        ("build ONNX model", f"{build_s:.2f} s"),
        ("compile (import/fuse/build)", " + ".join(f"{v:.2f}" for v in compiled.timings.values()) + " s"),
        ("kernels tuned / by hand / total",
         f"{len(compiled.tuned_kernels)} / {len(compiled.hand_kernels)} / {len(compiled.kernels)}"),
        ("tvmdm run (median of 5)", f"{tvm_s * 1e3:.1f} ms"),
        ("onnxruntime run (median of 5)", f"{ort_s * 1e3:.1f} ms"),
        ("max abs error vs onnxruntime", f"{result.max_abs_err:.3g}"),
        ("check (atol=rtol=1e-4)", "ok" if result.ok else "FAILED"),
    ]
    rows.insert(-2, ("tvmdm / onnxruntime", f"{tvm_s / ort_s:.2f}x time"))
    rows += bf16_rows
    width = max(len(r[0]) for r in rows)
    print("-" * (width + 16))
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    print("-" * (width + 16))
    return 0 if result.ok and bf16_ok else 1


def _bf16_rows(proto, name, batch, seq, target, feeds, reference, ort_s, tuning_logs) -> tuple[list, bool]:
    """The same model with bf16 contractions (where this CPU has AVX512-BF16), against fp32 onnxruntime."""
    import tvmdm
    from schedules.bf16 import has_bf16_dot
    from tvmdm.build.check import compare_outputs
    from tvmdm.build.shapes import resolve_shapes
    from tvmdm.core.precision import BF16_MAX_REL_ERR
    from tvmdm.core.target import make_target

    if not has_bf16_dot(make_target(target)):
        return [("precision bf16", "skipped: this target has no AVX512-BF16")], True
    compiled = tvmdm.compile(proto, target=target, shapes=resolve_shapes(name, None, batch, seq), precision="bf16",
                             tuning_logs=tuning_logs)
    outputs = compiled.run(feeds)
    bf16_s = _median_seconds(lambda: compiled.run(feeds), repeat=5)
    check = compare_outputs(compiled.output_names, outputs, reference, atol=0, rtol=0)
    rel = max(o.max_rel_err for o in check.outputs)
    return [
        ("tvmdm bf16 run (median of 5)", f"{bf16_s * 1e3:.1f} ms"),
        ("tvmdm bf16 / onnxruntime fp32", f"{bf16_s / ort_s:.2f}x time"),
        (f"bf16 max rel error (<= {BF16_MAX_REL_ERR:g})", f"{rel:.3g} {'ok' if rel <= BF16_MAX_REL_ERR else 'FAILED'}"),
    ], rel <= BF16_MAX_REL_ERR
