"""CUDA modules build here without a GPU (dlight-scheduled); running them needs one and says so."""
import pytest

import tvmdm
from tests.helpers.cuda import cuda_source as _cuda_source


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_build_without_gpu(tmp_path, tiny_layer, arch):
    compiled = tvmdm.compile(tiny_layer, target=f"cuda:{arch}")
    source = _cuda_source(compiled)
    assert source.count("__global__") >= 5  # one kernel per fused group
    assert "threadIdx.x" in source and "blockIdx.x" in source  # dlight bound every kernel to threads
    path = compiled.export(tmp_path / "tiny-cuda.tvmdm")
    import tvm

    if not tvm.cuda(0).exist:
        with pytest.raises(tvmdm.TvmdmError, match="compiled for cuda, but no cuda device is present here"):
            compiled.run(tvmdm.random_inputs(compiled))
        with pytest.raises(tvmdm.ArtifactError, match="compiled for cuda, but this TVM runtime cannot load it here"):
            tvmdm.load(path)


def test_cuda_training_step_builds_without_gpu(tiny_layer):
    # every kernel of the step bound to threads by dlight, the one-kernel AdamW update (three outputs) included
    step = tvmdm.compile_train_step(tiny_layer, loss="mse", batch=2, seq=8, target="cuda:sm_80", fusion="paper")
    source = _cuda_source(step)
    assert "adamw" in source and "threadIdx.x" in source and "blockIdx.x" in source
