"""Seeded mutants of a model, its run inputs and its artifact, each tried with tvmdm and onnxruntime.

Run as a child process (``python -m tests.helpers.fuzz KIND OUT_JSONL SEED COUNT``) so that a signal or a hang
shows as the child's exit, with the case it was in (a "start" line precedes every case) named in OUT_JSONL.
Every case ends in one outcome:
- ``tvmdm_error``: tvmdm raised one of its own errors (a TvmdmError: the message names what is at fault);
- ``same``: tvmdm's outputs match onnxruntime's;
- ``differs``: tvmdm answered where onnxruntime refused, or answered differently (a silent wrong answer);
- ``bare``: any other exception (a traceback the user was not meant to see).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

import numpy as np
import onnx

MODEL = "bert-tiny-layer"
SHAPES = {"hidden_states": (2, 8, 32), "attention_mask": (2, 8)}


def feeds(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    mask = np.ones(SHAPES["attention_mask"], np.int64)
    mask[1, 5:] = 0
    return {"hidden_states": rng.standard_normal(SHAPES["hidden_states"]).astype(np.float32),
            "attention_mask": mask}


def ort_run(model_bytes: bytes, inputs: dict):
    """onnxruntime's outputs, or None where it refuses the model or the inputs."""
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
        return session.run(None, inputs)
    except Exception:  # noqa: BLE001 - any refusal counts as one
        return None


def close(ours, theirs) -> bool:
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape or not np.array_equal(np.isfinite(a), np.isfinite(b)):
            return False
        finite = np.isfinite(b)
        scale = max(1.0, float(np.abs(b[finite]).max())) if finite.any() else 1.0
        if not np.allclose(a[finite], b[finite], rtol=1e-3, atol=1e-4 * scale):
            return False
    return True


def outcome(tvmdm_call, reference) -> dict:
    """Run ``tvmdm_call`` (returns outputs) and classify it against ``reference`` (outputs or None)."""
    import tvmdm

    try:
        ours = tvmdm_call()
    except tvmdm.TvmdmError as err:
        return {"outcome": "tvmdm_error", "detail": str(err)[:300]}
    except Exception as err:  # noqa: BLE001 - what the test looks for
        return {"outcome": "bare", "detail": f"{type(err).__name__}: {str(err)[:300]}",
                "where": traceback.format_exc()[-1500:]}
    if reference is None:
        return {"outcome": "differs", "detail": "tvmdm answered; onnxruntime refused"}
    if not close(ours, reference):
        return {"outcome": "differs", "detail": "outputs differ from onnxruntime's"}
    return {"outcome": "same"}


# ---------------------------------------------------------------------------------------------------- models

def _mutate_model(proto: onnx.ModelProto, rng) -> tuple[str, bytes]:
    data = proto.SerializeToString()
    kind = ["truncate", "bitflip", "dims", "attribute", "short_initializer"][int(rng.integers(5))]
    if kind == "truncate":
        return kind, data[:int(rng.integers(1, len(data)))]
    if kind == "bitflip":
        flipped = bytearray(data)
        for _ in range(int(rng.integers(1, 9))):
            flipped[int(rng.integers(len(flipped)))] ^= 1 << int(rng.integers(8))
        return kind, bytes(flipped)
    mutant = onnx.ModelProto()
    mutant.CopyFrom(proto)
    graph = mutant.graph
    if kind == "dims":
        holders = [v.type.tensor_type.shape.dim for v in list(graph.input) + list(graph.output)]
        holders += [t.dims for t in graph.initializer]
        dims = holders[int(rng.integers(len(holders)))]
        if len(dims):
            i = int(rng.integers(len(dims)))
            value = int(rng.choice([0, 1, 3, 7, 64, 10**6]))
            if isinstance(dims[i], int):
                dims[i] = value
            else:
                dims[i].Clear()
                dims[i].dim_value = value
    elif kind == "attribute":
        attrs = [(n, a) for n in graph.node for a in n.attribute
                 if a.type in (onnx.AttributeProto.INT, onnx.AttributeProto.INTS, onnx.AttributeProto.FLOAT)]
        if attrs:
            node, attr = attrs[int(rng.integers(len(attrs)))]
            if attr.type == onnx.AttributeProto.INT:
                attr.i = int(rng.choice([-3, -1, 0, 1, 2, 5, 100]))
            elif attr.type == onnx.AttributeProto.FLOAT:
                attr.f = float(rng.choice([-1.0, 0.0, 1e30, np.nan]))
            elif len(attr.ints):
                attr.ints[int(rng.integers(len(attr.ints)))] = int(rng.choice([-1, 0, 1, 3, 9]))
            kind = f"attribute {node.name or node.op_type} {onnx.helper.printable_attribute(attr)}"
    else:
        tensors = [t for t in graph.initializer if len(t.raw_data) > 4]
        if tensors:
            tensor = tensors[int(rng.integers(len(tensors)))]
            tensor.raw_data = tensor.raw_data[:int(rng.integers(len(tensor.raw_data)))]
    return kind, mutant.SerializeToString()


def fuzz_models(write, seed: int, count: int) -> None:
    import tvmdm

    proto = tvmdm.default_model(MODEL)
    rng = np.random.default_rng(seed)
    inputs = feeds(seed)
    with tempfile.TemporaryDirectory() as tmp:
        for case in range(count + 1):  # case 0: the intact model, the control
            kind, data = _mutate_model(proto, rng) if case else ("intact", proto.SerializeToString())
            write({"case": case, "start": kind})
            path = os.path.join(tmp, f"mutant{case}.onnx")
            with open(path, "wb") as f:
                f.write(data)
            result = outcome(lambda: tvmdm.compile(path, shapes={k: list(v) for k, v in SHAPES.items()})
                             .run(inputs), ort_run(data, inputs))
            write(dict(result, case=case, kind=kind))


# ---------------------------------------------------------------------------------------------------- inputs

def _mutate_inputs(rng) -> tuple[str, dict]:
    good = feeds(int(rng.integers(1 << 30)))
    name = ["hidden_states", "attention_mask"][int(rng.integers(2))]
    kind = ["dtype", "rank", "dim", "missing", "extra", "values", "not_array"][int(rng.integers(7))]
    value = good[name]
    if kind == "dtype":
        good[name] = value.astype([np.float64, np.int32, np.float16, np.bool_, np.uint8][int(rng.integers(5))])
    elif kind == "rank":
        good[name] = value[..., None] if rng.integers(2) else value.reshape(-1)
    elif kind == "dim":
        shape = list(value.shape)
        shape[int(rng.integers(len(shape)))] = int(rng.choice([0, 1, 3, 9, 64]))
        good[name] = np.resize(value, shape)
    elif kind == "missing":
        del good[name]
    elif kind == "extra":
        good["unexpected"] = value
    elif kind == "values":
        if value.dtype.kind == "f":
            good[name] = np.full_like(value, float(rng.choice([np.nan, np.inf, -np.inf, 1e38])))
        else:
            good[name] = np.full_like(value, int(rng.choice([-1, 2, 2**62])))
    else:
        good[name] = value.tolist() if rng.integers(2) else "text"
    return kind, good


def fuzz_inputs(write, seed: int, count: int) -> None:
    import tvmdm

    proto = tvmdm.default_model(MODEL)
    compiled = tvmdm.compile(proto)
    rng = np.random.default_rng(seed)
    for case in range(count + 1):  # case 0: the intact inputs, the control
        kind, inputs = _mutate_inputs(rng) if case else ("intact", feeds(seed))
        write({"case": case, "start": kind})
        # nested lists are an input form tvmdm takes (tvmdm.runtime.feeds): onnxruntime gets them as the arrays
        # they stand for; any other non-array must be refused
        as_arrays = {k: np.asarray(v) if isinstance(v, list) else v for k, v in inputs.items()}
        arrays = all(isinstance(v, np.ndarray) for v in as_arrays.values())
        reference = ort_run(proto.SerializeToString(), as_arrays) if arrays else None
        write(dict(outcome(lambda: compiled.run(inputs), reference), case=case, kind=kind))


# ---------------------------------------------------------------------------------------------------- artifacts

def fuzz_artifacts(write, seed: int, count: int) -> None:
    import tvmdm

    proto = tvmdm.default_model(MODEL)
    rng = np.random.default_rng(seed)
    inputs = feeds(seed)
    reference = ort_run(proto.SerializeToString(), inputs)
    with tempfile.TemporaryDirectory() as tmp:
        data = open(tvmdm.compile(proto).export(os.path.join(tmp, "good.tvmdm")), "rb").read()
        for case in range(count + 1):  # case 0: the intact artifact, the control
            mutant = bytearray(data)
            kind = ["truncate", "bitflip"][int(rng.integers(2))] if case else "intact"
            if kind == "truncate":
                mutant = mutant[:int(rng.integers(1, len(mutant)))]
            elif kind == "bitflip":
                for _ in range(int(rng.integers(1, 5))):
                    mutant[int(rng.integers(len(mutant)))] ^= 1 << int(rng.integers(8))
            write({"case": case, "start": kind})
            path = os.path.join(tmp, f"mutant{case}.tvmdm")
            with open(path, "wb") as f:
                f.write(bytes(mutant))
            write(dict(outcome(lambda: tvmdm.load(path).run(inputs), reference), case=case, kind=kind))


KINDS = {"models": fuzz_models, "inputs": fuzz_inputs, "artifacts": fuzz_artifacts}


def main(kind: str, out: str, seed: int, count: int) -> None:
    with open(out, "w") as sink:
        def write(entry):
            sink.write(json.dumps(entry) + "\n")
            sink.flush()

        KINDS[kind](write, seed, count)
        write({"done": True})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
