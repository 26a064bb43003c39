"""transform.index_guards: no gather reads outside its table; an index outside it is an InputError raised by the
compiled module itself (so an artifact whose manifest lost its index bounds still refuses, never segfaults)."""
import numpy as np
import pytest
from tvm.script import ir as I
from tvm.script import relax as R

import tvmdm
from tests.helpers.artifacts import edited_copy
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


def test_the_guarded_module_is_well_formed_and_normalized():
    """assert_op is impure (main must say so), and its calls carry their types: a later mutator that had to fill
    them in would change main's structural hash in place, which BlockBuilder.update_func refuses (FastMath did,
    under the stock fusion)."""
    from tvm import relax
    from tvm_ffi import structural_hash

    guarded = guard_gathers()(Embedding)
    relax.analysis.well_formed(guarded)  # raises on an impure call in a pure function
    assert not guarded["main"].is_pure
    @relax.expr_functor.mutator
    class Identity(relax.PyExprMutator):
        pass

    before = structural_hash(guarded["main"])
    Identity(guarded).visit_expr(guarded["main"])
    assert structural_hash(guarded["main"]) == before


def test_the_stock_fusion_keeps_the_guard(small):
    model, _, rows = small
    compiled = tvmdm.compile(model, fusion="tvm")
    assert compiled.check(tvmdm.random_inputs(compiled, batch=1, seq=8)).ok
    with pytest.raises(tvmdm.InputError, match="sequences may be at most"):
        compiled.run(tvmdm.random_inputs(compiled, batch=1, seq=rows + 1))


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
    # tampered, checksums and all: the runner's own check of input_ids is off
    tampered = edited_copy(path, tmp_path / "tampered.tvmdm", lambda manifest: manifest.update(index_bounds={}))
    runner = tvmdm.load(str(tampered))
    assert runner.index_bounds == {}
    feeds = tvmdm.random_inputs(runner, batch=1, seq=4)
    feeds["input_ids"][0, 1] = 10 ** 6
    with pytest.raises(tvmdm.InputError, match=r"input 'input_ids' holds index 1000000, outside \[0, 1000\)"):
        runner.run(feeds)
    feeds["input_ids"][0, 1] = 3
    np.testing.assert_allclose(runner.run(feeds)[0], compiled.run(feeds)[0], rtol=1e-5, atol=1e-5)


def test_cuda_modules_clip_their_gathers_and_assert(small):
    """On CUDA the guard's reductions run on the device and assert_op reads one boolean back; every gather kernel
    clamps its index into the table (the frontend's fast mode read past it)."""
    import re

    from tests.helpers.cuda import cuda_source

    model, _, rows = small
    compiled = tvmdm.compile(model, target="cuda:sm_90")
    assert compiled.mod["main"].script().count("relax.run.assert_op") == 3  # word, token type, position
    source = cuda_source(compiled)
    clamps = set(re.findall(r"min\(max\(\(int64_t\)0, \w+_ptr\[.*?\]\), \(int64_t\)(\d+)\)", source))
    assert {"999", "1", str(rows - 1)} <= clamps, clamps


def test_a_training_graph_clips_its_indices_before_the_gradient():
    """No assert in a graph the gradient pass must differentiate: the indices themselves are clipped, so the
    forward gather and the gradient's scatter both stay inside the table."""
    text = guard_gathers(check=False)(Embedding)["main"].script()
    assert "R.clip(ids, 0, 4)" in text and "assert" not in text


def test_a_training_step_longer_than_the_position_table_is_refused_at_compile(small):
    model, _, rows = small
    with pytest.raises(tvmdm.ShapeError, match=rf"position {rows + 3} is outside the model's position table of "
                                               rf"{rows} rows: sequences may be at most {rows} tokens long"):
        tvmdm.compile_train_step(model, batch=1, seq=rows + 4)


DEPLOYED = """
import sys
import numpy as np
import tvmdm
runner = tvmdm.load(sys.argv[1])
good = tvmdm.random_inputs(runner, batch=1, seq=4)
runner.run(good)
try:
    runner.run(tvmdm.random_inputs(runner, batch=1, seq=int(sys.argv[2]) + 1))
except tvmdm.InputError as err:
    print("refused:", err)
assert "tvm.relax" not in sys.modules, "relax was imported"
"""


def test_a_deployed_artifact_checks_with_tvms_runtime_alone(small, tmp_path):
    """TVM_USE_RUNTIME_LIB=1 loads no Relax, whose Python package registers assert_op's VM function: the runner
    provides it."""
    import os
    import subprocess
    import sys

    _, compiled, rows = small
    path = compiled.export(tmp_path / "m.tvmdm")
    done = subprocess.run([sys.executable, "-c", DEPLOYED, path, str(rows)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TVM_USE_RUNTIME_LIB="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"refused: position {rows} is outside the model's position table of {rows} rows" in done.stdout
