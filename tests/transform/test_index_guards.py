"""transform.index_guards: no gather reads outside its table; an index outside it is an InputError raised by the
compiled module itself (so an artifact whose manifest lost its index bounds still refuses, never segfaults)."""
import io
import json
import tarfile

import numpy as np
import pytest
from tvm.script import ir as I
from tvm.script import relax as R

import tvmdm
from tvmdm.transform.index_guards import guard_gathers


@I.ir_module
class Embedding:
    @R.function
    def main(ids: R.Tensor((2, 3), "int64"), table: R.Tensor((5, 4), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            out = R.take(table, ids, axis=0)
            R.output(out)
        return out


def test_the_pass_clips_the_gather_and_asserts_after_the_graph():
    guarded = guard_gathers()(Embedding)["main"]
    text = guarded.script()
    assert 'mode="clip"' in text and "R.assert_op" in text
    assert "input 'ids' holds index {}, outside [0, 5)" in text
    assert guard_gathers()(guard_gathers()(Embedding))["main"].script().count("R.assert_op") == 2  # one a pass


@pytest.fixture(scope="module")
def small():
    model = tvmdm.default_model("bert-small")
    rows = next(i.dims[0] for i in model.graph.initializer if "position" in i.name)
    return model, tvmdm.compile(model), rows


def test_a_sequence_longer_than_the_position_table_is_refused(small):
    _, compiled, rows = small
    feeds = tvmdm.random_inputs(compiled, batch=1, seq=rows)
    assert compiled.check(feeds).ok  # the longest sequence the table allows still runs
    for seq in (rows + 1, 4 * rows):
        with pytest.raises(tvmdm.InputError, match=rf"position {seq - 1} is outside the model's position table of "
                                                   rf"{rows} rows: sequences may be at most {rows} tokens long"):
            compiled.run(tvmdm.random_inputs(compiled, batch=1, seq=seq))


def test_a_static_compile_past_the_position_table_is_refused_at_run(small):
    model, _, rows = small
    shape = [1, rows + 8]
    compiled = tvmdm.compile(model, shapes={n: shape for n in ("input_ids", "attention_mask", "token_type_ids")})
    with pytest.raises(tvmdm.InputError, match=f"sequences may be at most {rows} tokens long"):
        compiled.run(tvmdm.random_inputs(compiled, batch=1, seq=rows + 8))


def test_an_artifact_whose_manifest_lost_its_bounds_still_refuses(small, tmp_path):
    _, compiled, _ = small
    path = compiled.export(tmp_path / "m.tvmdm")
    with tarfile.open(path) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    manifest = json.loads(members["manifest.json"])
    manifest["index_bounds"] = {}  # tampered: the runner's own check of input_ids is off
    members["manifest.json"] = json.dumps(manifest).encode()
    tampered = tmp_path / "tampered.tvmdm"
    with tarfile.open(tampered, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    runner = tvmdm.load(str(tampered))
    assert runner.index_bounds == {}
    feeds = tvmdm.random_inputs(runner, batch=1, seq=4)
    feeds["input_ids"][0, 1] = 10 ** 6
    with pytest.raises(tvmdm.InputError, match=r"input 'input_ids' holds index 1000000, outside \[0, 1000\)"):
        runner.run(feeds)
    feeds["input_ids"][0, 1] = 3
    np.testing.assert_allclose(runner.run(feeds)[0], compiled.run(feeds)[0], rtol=1e-5, atol=1e-5)


def test_cuda_modules_keep_the_frontend_gathers(small):
    """No assert_op on CUDA (its condition would live on the device): the runner's input check holds there."""
    model, _, _ = small
    compiled = tvmdm.compile(model, target="cuda:sm_90")
    assert "assert" not in compiled.mod["main"].script()
