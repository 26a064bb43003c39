"""The tvmdm command line: compile to an artifact, run it, run --check against onnxruntime."""
import subprocess
import sys

import numpy as np
import onnx

from tvmdm.cli.main import main


def test_compile_then_run_artifact(tmp_path, capsys, tiny_layer):
    model = tmp_path / "layer.onnx"
    onnx.save(tiny_layer, str(model))
    out = tmp_path / "layer.tvmdm"
    assert main(["compile", str(model), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "input hidden_states: float32['batch', 'seq', 32]" in text and f"wrote {out}" in text
    result = tmp_path / "out.npz"
    assert main(["run", str(out), "--batch", "3", "--seq", "5", "-o", str(result)]) == 0
    assert "output: float32[3, 5, 32]" in capsys.readouterr().out
    with np.load(result) as data:
        assert data["output"].shape == (3, 5, 32)


def test_run_check_with_bound_shape(capsys):
    assert main(["run", "bert-small", "--shape", "input_ids=2x6", "--shape", "attention_mask=2x6",
                 "--shape", "token_type_ids=2x6", "--seq", "6", "--check"]) == 0
    text = capsys.readouterr().out
    assert "last_hidden_state: float32[2, 6, 256]" in text and "check vs onnxruntime" in text and "FAILED" not in text


def test_bad_shape_flag_is_a_usage_error(capsys):
    proc = subprocess.run([sys.executable, "-m", "tvmdm", "run", "bert-small", "--shape", "input_ids=2xfoo"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "bad --shape 'input_ids=2xfoo'" in proc.stderr and "Traceback" not in proc.stderr


def test_check_needs_onnx_source(tmp_path, capsys, tiny_compiled):
    path = tiny_compiled.export(tmp_path / "t.tvmdm")
    assert main(["run", path, "--check"]) == 2
    assert "--check needs the ONNX model" in capsys.readouterr().err


def test_compile_reports_shared_initializers(tmp_path, capsys):
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="/q"), helper.make_node("MatMul", ["a", "w"], ["y"], name="/k")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], initializer=[w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    assert main(["compile", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.tvmdm")]) == 0
    assert "1 initializer(s) read by several nodes" in capsys.readouterr().out


def test_version_and_one_meaning_of_batch_and_seq(tmp_path, capsys, tiny_layer):
    proc = subprocess.run([sys.executable, "-m", "tvmdm", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("tvmdm 0.") and "apache-tvm 0.27" in proc.stdout
    model = tmp_path / "layer.onnx"
    onnx.save(tiny_layer, str(model))
    out = tmp_path / "layer.tvmdm"
    assert main(["compile", str(model), "--batch", "3", "--seq", "5", "-o", str(out)]) == 0  # bound, as in tune
    assert "input hidden_states: float32[3, 5, 32]" in capsys.readouterr().out
    assert main(["run", str(out)]) == 0  # synthetic inputs of the size it was compiled for
    assert "output: float32[3, 5, 32]" in capsys.readouterr().out
