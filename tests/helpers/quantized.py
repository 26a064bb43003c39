"""Small quantized ONNX models as onnxruntime's dynamic quantization writes them (DynamicQuantizeLinear, then
MatMulInteger against an int8 initializer, the scale multiply and a bias), and their tiny HF twins.

Their weights keep every pair of consecutive rows within |w[2i] + w[2i+1]| <= 128 in each column (values up to
127 still occur), unless ``full_range``: onnxruntime's AVX2 kernel (vpmaddubsw, CPUs without VNNI) adds those
pairs of u8 x s8 products in int16 and saturates beyond it, so only such weights give the exact integers there
to compare with. ``full_range`` weights (uniform in [-127, 127]) are for comparisons with numpy's integers."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def int8_weight(rng, k: int, n: int, full_range: bool = False) -> np.ndarray:
    """[k, n] int8 weights (see the module doc)."""
    weight = rng.integers(-127, 128, size=(k, n))
    if not full_range:
        pairs = weight[:k - k % 2].reshape(k // 2, 2, n)
        over = np.abs(pairs.sum(axis=1)) > 128
        pairs[:, 1][over] *= -1  # opposite signs: the pair's sum is within 127
    return weight.astype(np.int8)


def int8_matmul_model(k: int, n: int, w_zero_point: int = 0, seed: int = 0, full_range: bool = False,
                      weight: np.ndarray | None = None) -> onnx.ModelProto:
    """y [batch, seq, n] = dequantize(MatMulInteger(DynamicQuantizeLinear(x), W)) + bias, x [batch, seq, k];
    W is ``weight`` where given."""
    rng = np.random.default_rng(seed)
    weight = int8_weight(rng, k, n, full_range) if weight is None else weight
    inits = [numpy_helper.from_array(weight, "W"),
             numpy_helper.from_array(np.array(w_zero_point, np.int8), "W_zero_point"),
             numpy_helper.from_array(np.array(0.004, np.float32), "W_scale"),
             numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "bias")]
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["x_q", "x_scale", "x_zero_point"]),
             helper.make_node("MatMulInteger", ["x_q", "W", "x_zero_point", "W_zero_point"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["acc_f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x_scale", "W_scale"], ["scale"]),
             helper.make_node("Mul", ["acc_f", "scale"], ["product"]),
             helper.make_node("Add", ["product", "bias"], ["y"])]
    return _model("int8_matmul", nodes, inits, k, n)


def int8_matmul_reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """int8_matmul_model's output in numpy: ONNX's DynamicQuantizeLinear, the exact integer product, then the
    fp32 epilogue."""
    inits = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    high, low = max(0.0, float(x.max())), min(0.0, float(x.min()))
    scale = np.float32((high - low) / 255)
    zero_point = np.clip(np.round(-low / scale), 0, 255)
    x_q = np.clip(np.round(x / scale) + zero_point, 0, 255).astype(np.int64)
    acc = (x_q - int(zero_point)) @ (inits["W"].astype(np.int64) - int(inits["W_zero_point"]))
    return acc.astype(np.float32) * (scale * inits["W_scale"]) + inits["bias"]


def _model(name: str, nodes, inits, k: int, n: int) -> onnx.ModelProto:
    """x [batch, seq, k] -> y [batch, seq, n] through ``nodes``, checked."""
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def quantized_export(hf_export, tmp_path, family: str = "bert", dynamo: bool = False) -> str:
    """The tiny HF export of ``family`` (torch's legacy exporter, or ``dynamo``: the default one since torch
    2.9) through onnxruntime's quantize_dynamic (QInt8 weights)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path = str(tmp_path / f"{family}-{'dynamo' if dynamo else 'legacy'}-int8.onnx")
    source = hf_export(family, dynamo=True, opset=18) if dynamo else hf_export(family)
    quantize_dynamic(source, path, weight_type=QuantType.QInt8)
    return path


def qdq_matmul_model(k: int, n: int, activation: str = "uint8", per_column: bool = False,
                     seed: int = 0) -> onnx.ModelProto:
    """The same contraction in QDQ format (what static quantization and other tools write): QuantizeLinear /
    DequantizeLinear around the activations with a fixed scale and zero point, DequantizeLinear on the int8
    weight (one scale, or ``per_column`` one per output column), then a float MatMul and the bias."""
    rng = np.random.default_rng(seed)
    weight = int8_weight(rng, k, n)
    x_zero_point = np.array(131 if activation == "uint8" else 3, dtype=activation)
    inits = [numpy_helper.from_array(weight, "W"),
             numpy_helper.from_array(np.zeros(n if per_column else (), np.int8), "W_zero_point"),
             numpy_helper.from_array(rng.uniform(0.002, 0.006, n).astype(np.float32) if per_column else
                                     np.array(0.004, np.float32), "W_scale"),
             numpy_helper.from_array(np.array(0.02, np.float32), "x_scale"),
             numpy_helper.from_array(x_zero_point, "x_zero_point"),
             numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "bias")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero_point"], ["x_q"]),
             helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero_point"], ["x_dq"]),
             helper.make_node("DequantizeLinear", ["W", "W_scale", "W_zero_point"], ["W_dq"], axis=1),
             helper.make_node("MatMul", ["x_dq", "W_dq"], ["product"]),
             helper.make_node("Add", ["product", "bias"], ["y"])]
    return _model("qdq_matmul", nodes, inits, k, n)
