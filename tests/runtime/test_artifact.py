"""Compiled.export / tvmdm.load: one file, run in a fresh process that cannot import onnx."""
import json
import os
import subprocess
import sys
import tarfile
import textwrap

import numpy as np
import pytest

import tvmdm
from tests.helpers.artifacts import edited_copy

# The child process blocks onnx and onnxruntime imports, as on a deployment machine without them.
LOAD_AND_RUN = textwrap.dedent("""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("onnx", "onnxruntime", "onnxscript", "torch"):
                raise ImportError(f"{name} is not installed here")
    sys.meta_path.insert(0, Block())
    import numpy as np, tvmdm
    runner = tvmdm.load(sys.argv[1])
    for i, path in enumerate(sys.argv[2:]):
        with np.load(path) as data:
            out = runner.run({k: data[k] for k in data.files})
        np.savez(path + ".out.npz", *out)
    print("loaded", ",".join(runner.input_names), "->", ",".join(runner.output_names))
""")


def test_round_trip_in_fresh_process_without_onnx(tmp_path):
    compiled = tvmdm.compile(tvmdm.default_model("bert-small"))
    artifact = compiled.export(tmp_path / "bert-small.tvmdm")
    feeds_list = [tvmdm.random_inputs(compiled, batch=2, seq=8), tvmdm.random_inputs(compiled, batch=3, seq=11, seed=1)]
    paths = []
    for i, feeds in enumerate(feeds_list):
        paths.append(str(tmp_path / f"in{i}.npz"))
        np.savez(paths[-1], **feeds)
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_RUN, artifact, *paths], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded input_ids,attention_mask,token_type_ids -> last_hidden_state" in proc.stdout
    for feeds, path in zip(feeds_list, paths):
        with np.load(path + ".out.npz") as out:
            np.testing.assert_array_equal(out["arr_0"], compiled.run(feeds)[0])


def test_artifact_is_one_file_with_manifest(tmp_path, tiny_compiled):
    path = tiny_compiled.export(tmp_path / "tiny.tvmdm")
    assert os.listdir(tmp_path) == ["tiny.tvmdm"]
    with tarfile.open(path) as tar:
        assert sorted(tar.getnames()) == ["checksums.json", "manifest.json", "model.so", "params.npz"]
        manifest = json.loads(tar.extractfile("manifest.json").read())
    assert manifest["inputs"] == [{"name": "hidden_states", "shape": ["batch", "seq", 32], "dtype": "float32"},
                                  {"name": "attention_mask", "shape": ["batch", "seq"], "dtype": "int64"}]
    assert manifest["outputs"] == [{"name": "output", "shape": ["batch", "seq", 32], "dtype": "float32"}]
    assert manifest["params"] == list(tiny_compiled.params())
    loaded = tvmdm.load(path)
    feeds = tvmdm.random_inputs(loaded, batch=2, seq=4)
    np.testing.assert_array_equal(loaded.run(feeds)[0], tiny_compiled.run(feeds)[0])
    with pytest.raises(tvmdm.InputError, match="input 'hidden_states' has dtype float64"):
        loaded.run({**feeds, "hidden_states": feeds["hidden_states"].astype(np.float64)})


def test_damaged_artifacts(tmp_path, tiny_compiled):
    with pytest.raises(tvmdm.ArtifactError, match="artifact not found"):
        tvmdm.load(tmp_path / "none.tvmdm")
    junk = tmp_path / "junk.tvmdm"
    junk.write_bytes(b"not a tar at all")
    with pytest.raises(tvmdm.ArtifactError, match=f"{junk}: not a tvmdm artifact or damaged"):
        tvmdm.load(junk)
    good = tiny_compiled.export(tmp_path / "good.tvmdm")
    cut = tmp_path / "cut.tvmdm"
    cut.write_bytes(open(good, "rb").read()[:3000])
    with pytest.raises(tvmdm.ArtifactError, match="not a tvmdm artifact or damaged"):
        tvmdm.load(cut)


def test_deployed_runner_needs_only_tvms_runtime_library(tmp_path, tiny_compiled):
    # TVM_USE_RUNTIME_LIB=1: TVM loads libtvm_runtime alone; loading and running must not need the compiler
    # (tvmdm imports it lazily) and the weights are on the device only, read again from the file when asked.
    artifact = tiny_compiled.export(tmp_path / "tiny.tvmdm")
    feeds = tvmdm.random_inputs(tiny_compiled, batch=2, seq=5)
    np.savez(tmp_path / "in.npz", **feeds)
    check = textwrap.dedent("""
        import sys
        maps = open("/proc/self/maps").read()
        assert "libtvm_compiler" not in maps, "the compiler library was loaded"
        assert "tvm.relax" not in sys.modules and "onnx" not in sys.modules, sorted(sys.modules)
        names = list(runner.params())
        assert not runner._host_params and names == runner._param_names, names
        print("runtime only")
    """)
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_RUN + check, artifact, str(tmp_path / "in.npz")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "runtime only" in proc.stdout
    with np.load(tmp_path / "in.npz.out.npz") as out:
        np.testing.assert_array_equal(out["arr_0"], tiny_compiled.run(feeds)[0])
    loaded = tvmdm.load(artifact)
    loaded.run(feeds)
    for name, value in tiny_compiled.params().items():
        np.testing.assert_array_equal(loaded.params()[name], value)


def test_export_over_a_directory_is_refused_and_leaves_nothing(tmp_path, tiny_compiled):
    (tmp_path / "taken").mkdir()
    with pytest.raises(tvmdm.ArtifactError, match=rf"cannot write {tmp_path / 'taken'}: it is a directory"):
        tiny_compiled.export(tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no .partial left behind


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("inputs"), "no entry 'inputs' in the artifact's manifest.json or arrays"),
    (lambda m: m["outputs"][0].pop("shape"), "no entry 'shape' in the artifact's manifest.json or arrays"),
    (lambda m: m.update(index_bounds=[1, 2]), "manifest.json has a malformed entry"),
])
def test_a_hand_edited_manifest_is_an_artifact_error_naming_the_entry(tmp_path, tiny_compiled, edit, message):
    good = tiny_compiled.export(tmp_path / "good.tvmdm")
    edited = edited_copy(good, tmp_path / "edited.tvmdm", edit)
    with pytest.raises(tvmdm.ArtifactError, match=rf"{edited}: {message}"):
        tvmdm.load(edited)


def test_a_member_changed_after_export_is_refused_before_it_is_used(tmp_path, tiny_compiled):
    good = tiny_compiled.export(tmp_path / "good.tvmdm")
    data = bytearray(open(good, "rb").read())
    with tarfile.open(good) as tar:
        lib = tar.getmember("model.so")
    data[lib.offset_data + lib.size // 2] ^= 0x40  # one bit of the compiled code
    flipped = tmp_path / "flipped.tvmdm"
    flipped.write_bytes(bytes(data))
    with pytest.raises(tvmdm.ArtifactError, match=rf"{flipped}: model.so does not match its checksum"):
        tvmdm.load(flipped)


def test_deployed_training_step_needs_only_tvms_runtime_library(tmp_path, tiny_layer):
    # A training step compiled here trains elsewhere with libtvm_runtime alone (tvmdm.runtime.train_step, the
    # optimizer's and loss scaler's state from tvmdm.core.training): the same losses as the step it came from.
    step = tvmdm.compile_train_step(tiny_layer, loss="mse", batch=2, seq=8, optimizer=tvmdm.AdamW(lr=1e-2))
    feeds = tvmdm.random_inputs(step, batch=2, seq=8)
    labels = np.random.default_rng(1).standard_normal(step.target_spec.shape).astype(np.float32)
    np.savez(tmp_path / "batch.npz", **feeds, labels=labels)
    path = step.export(tmp_path / "step.tar")
    script = textwrap.dedent("""
        import json, sys
        import numpy as np
        import tvmdm
        step = tvmdm.load_train_step(sys.argv[1])
        with np.load(sys.argv[2]) as npz:
            batch = dict(npz)
        print(json.dumps([step.step(batch) for _ in range(2)]))
        assert "libtvm_compiler" not in open("/proc/self/maps").read(), "the compiler library was loaded"
        assert "tvm.relax" not in sys.modules and "onnx" not in sys.modules
        print("runtime only")
    """)
    proc = subprocess.run([sys.executable, "-c", script, path, str(tmp_path / "batch.npz")], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, TVM_USE_RUNTIME_LIB="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads(proc.stdout.splitlines()[0])
    batch = dict(feeds, labels=labels)
    assert losses == pytest.approx([step.step(batch), step.step(batch)], rel=1e-6)
    assert "runtime only" in proc.stdout
