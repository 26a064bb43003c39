"""Bad input gets a clear error naming what is wrong: files, operators, shapes, run() inputs, targets."""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvmdm
from tvmdm.cli.main import main as cli_main


def test_missing_file(tmp_path):
    path = tmp_path / "nope.onnx"
    with pytest.raises(tvmdm.ModelLoadError, match=f"model file not found: {path}"):
        tvmdm.compile(str(path))


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(tvmdm.ModelLoadError, match="is not a file"):
        tvmdm.compile(str(tmp_path))


def test_not_onnx(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("this is a text file, not a protobuf\n" * 10)
    with pytest.raises(tvmdm.ModelLoadError, match=rf"{path}: not a valid ONNX model"):
        tvmdm.compile(str(path))


def test_empty_file(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    with pytest.raises(tvmdm.ModelLoadError, match=rf"{path}: not a valid ONNX model"):
        tvmdm.compile(str(path))


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.95])
def test_truncated_file(tmp_path, tiny_layer, fraction):
    data = tiny_layer.SerializeToString()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(tvmdm.ModelLoadError, match=rf"{path}: "):
        tvmdm.compile(str(path))


def test_wrong_type_of_model():
    with pytest.raises(tvmdm.ModelLoadError, match="expected a path, an onnx.ModelProto or a tvm.IRModule, got int"):
        tvmdm.compile(42)


def _graph_with(node, extra_inputs=()):
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]), *extra_inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])


def test_unsupported_operator_names_op_and_node():
    model = _graph_with(helper.make_node("FancyAttention", ["x"], ["y"], name="/encoder/fancy_0", domain="com.example"))
    with pytest.raises(tvmdm.UnsupportedOperatorError,
                       match=r"unsupported ONNX operator\(s\): com.example.FancyAttention at node\(s\) /encoder/fancy_0"):
        tvmdm.compile(model)


def test_converter_failure_names_node():
    # A Reshape whose target size cannot fit the input: TVM's converter fails; the message names the node.
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [3, 5])
    node = helper.make_node("Reshape", ["x", "shape"], ["y"], name="/bad/reshape")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(tvmdm.UnsupportedOperatorError, match=r"cannot convert Reshape node '/bad/reshape'"):
        tvmdm.compile(model)


def test_node_reading_an_unknown_tensor():
    model = _graph_with(helper.make_node("Add", ["x", "ghost"], ["y"], name="/add"))
    with pytest.raises(tvmdm.ModelLoadError, match=r"node '/add' \(Add\) reads 'ghost'"):
        tvmdm.compile(model)


def _copy(model):
    out = onnx.ModelProto()  # onnx.save(save_as_external_data=True) rewrites the proto it is given
    out.CopyFrom(model)
    return out


def test_external_data_outside_model_folder(tmp_path, tiny_layer):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    onnx.save(_copy(tiny_layer), str(model_dir / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    assert tvmdm.compile(str(model_dir / "m.onnx")).check(
        tvmdm.random_inputs(tvmdm.compile(tiny_layer))).ok  # the honest layout loads
    saved = onnx.load(str(model_dir / "m.onnx"), load_external_data=False)
    for tensor in saved.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../secrets.bin"
    (tmp_path / "secrets.bin").write_bytes((model_dir / "weights.bin").read_bytes())
    onnx.save(saved, str(model_dir / "evil.onnx"))
    with pytest.raises(tvmdm.ModelLoadError, match=r"external data at '../secrets.bin', outside the model's folder"):
        tvmdm.compile(str(model_dir / "evil.onnx"))


def test_missing_external_data_file(tmp_path, tiny_layer):
    onnx.save(_copy(tiny_layer), str(tmp_path / "m.onnx"), save_as_external_data=True, location="w.bin", size_threshold=0)
    os.remove(tmp_path / "w.bin")
    with pytest.raises(tvmdm.ModelLoadError, match=r"external data file 'w.bin' of initializer .* not found"):
        tvmdm.compile(str(tmp_path / "m.onnx"))


# ---- shapes bound at compile time -------------------------------------------------------------------------

@pytest.mark.parametrize("shapes,message", [
    ({"hidden_states": [2, 8]}, r"input 'hidden_states' has rank 3 \['batch', 'seq', 32\], but shape \[2, 8\]"),
    ({"hidden_states": [2, 8, 64]}, r"input 'hidden_states' axis 2 is fixed to 32 in the model"),
    ({"hidden_states": [2, 8, 32], "attention_mask": [3, 8]},
     r"dim 'batch' bound to 2 by input 'hidden_states' but to 3 by input 'attention_mask'"),
    ({"input_ids": [2, 8]}, r"shapes given for unknown inputs \['input_ids'\]"),
    ({"hidden_states": [0, 8, 32]}, r"input 'hidden_states' axis 0: size must be positive"),
])
def test_bound_shape_contradicts_model(tiny_layer, shapes, message):
    with pytest.raises(tvmdm.ShapeError, match=message):
        tvmdm.compile(tiny_layer, shapes=shapes)


# ---- inputs given to run() ------------------------------------------------------------------------------

def _feeds(compiled, **changes):
    feeds = tvmdm.random_inputs(compiled, batch=2, seq=8)
    feeds.update(changes)
    return {k: v for k, v in feeds.items() if v is not None}


@pytest.mark.parametrize("change,message", [
    (dict(attention_mask=None), r"missing \['attention_mask'\]"),
    (dict(token_type_ids=np.zeros((2, 8), np.int64)), r"unexpected \['token_type_ids'\]"),
    (dict(hidden_states=np.zeros((2, 8, 32), np.float64)), r"input 'hidden_states' has dtype float64, the model expects float32"),
    (dict(attention_mask=np.ones((2, 8), np.int32)), r"input 'attention_mask' has dtype int32, the model expects int64"),
    (dict(hidden_states=np.zeros((16, 32), np.float32)), r"input 'hidden_states' has rank 2 \(shape \[16, 32\]\), the model expects rank 3"),
    (dict(hidden_states=np.zeros((2, 8, 31), np.float32)), r"input 'hidden_states' axis 2 has size 31, the model was compiled for 32"),
    (dict(attention_mask=np.ones((2, 9), np.int64)), r"dim 'seq' is 8 in input 'hidden_states' but 9 in input 'attention_mask'"),
    (dict(attention_mask=[[1] * 8] * 3), r"dim 'batch' is 2 in input 'hidden_states' but 3 in input 'attention_mask'"),
    (dict(attention_mask={"ids": 1}), r"input 'attention_mask' must be a numpy array, a torch tensor, a DLPack "
                                      r"exporter or a list, got dict"),
])
def test_bad_run_inputs(tiny_compiled, change, message):
    with pytest.raises(tvmdm.InputError, match=message):
        tiny_compiled.run(_feeds(tiny_compiled, **change))


def test_run_needs_a_dict(tiny_compiled):
    with pytest.raises(tvmdm.InputError, match="inputs must be a mapping of input name -> array \\(a dict, a tokenizer's BatchEncoding\\), got list"):
        tiny_compiled.run([np.zeros((2, 8, 32), np.float32)])


def test_out_of_range_token_ids_are_refused():
    compiled = tvmdm.compile(tvmdm.default_model("bert-small"))
    feeds = tvmdm.random_inputs(compiled, batch=1, seq=4)
    feeds["input_ids"][0, 2] = -1
    with pytest.raises(tvmdm.InputError, match=r"input 'input_ids' holds index -1, outside \[0, 1000\)"):
        compiled.run(feeds)
    feeds["input_ids"][0, 2] = 1000
    with pytest.raises(tvmdm.InputError, match=r"holds index 1000, outside \[0, 1000\) of the table that node"):
        compiled.run(feeds)


def test_unknown_target(tiny_layer):
    with pytest.raises(tvmdm.TargetError, match=r"unknown target 'tpu'"):
        tvmdm.compile(tiny_layer, target="tpu")
    with pytest.raises(tvmdm.TargetError, match=r"unknown CUDA arch 'sm_12'"):
        tvmdm.compile(tiny_layer, target="cuda:sm_12")


def test_unknown_compile_option(tiny_layer):
    with pytest.raises(TypeError, match=r"unknown options \['fast'\]"):
        tvmdm.compile(tiny_layer, fast=True)


def test_cli_reports_errors_in_one_line(tmp_path, capsys):
    missing = tmp_path / "missing.onnx"
    assert cli_main(["run", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"tvmdm run: error: model file not found: {missing}"
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00garbage")
    assert cli_main(["compile", str(bad)]) == 2
    assert "not a valid ONNX model" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    (None, "--inputs {path}: no such file"),
    (b"not numpy at all", "--inputs {path}: not an .npz of named arrays"),
    ("npy", "--inputs {path}: not an .npz of named arrays"),
])
def test_cli_bad_inputs_file_is_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "inputs.npz"
    if content == "npy":
        with open(path, "wb") as f:
            np.save(f, np.zeros(3))
    elif content is not None:
        path.write_bytes(content)
    assert cli_main(["run", "bert-tiny-layer", "--inputs", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tvmdm run: error: " + message.format(path=path)), err


def test_cli_file_errors_name_the_file(tmp_path, capsys):
    out = tmp_path / "no" / "such" / "folder" / "m.tvmdm"
    assert cli_main(["compile", "bert-tiny-layer", "-o", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (f"tvmdm compile: error: cannot write {out}: folder {out.parent} "
                                               "does not exist")
    assert cli_main(["run", "bert-tiny-layer", "--output", str(out.parent / "o.npz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"tvmdm run: error: {out.parent / 'o.npz'}: No such file or directory"
