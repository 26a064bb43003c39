import pytest


@pytest.fixture(scope="session")
def hf_export(tmp_path_factory):
    """hf_export(family, dynamo=, dynamic=, opset=, size=) -> path of a real transformers export, made once per session."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tvmdm.models import hf_export as hf_exports

    root = tmp_path_factory.mktemp("hf")
    cache = {}

    def make(family, *, dynamo=False, dynamic=True, opset=17, size="tiny"):
        key = (family, dynamo, dynamic, opset, size)
        if key not in cache:
            name = f"{family}-{size}-{'dynamo' if dynamo else 'legacy'}-{'dyn' if dynamic else 'static'}-op{opset}.onnx"
            cache[key] = hf_exports.export(family, str(root / name), dynamo=dynamo, dynamic=dynamic, opset=opset,
                                           size=size)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_layer():
    import tvmdm

    return tvmdm.default_model("bert-tiny-layer")


@pytest.fixture(scope="session")
def tiny_compiled(tiny_layer):
    import tvmdm

    return tvmdm.compile(tiny_layer)
