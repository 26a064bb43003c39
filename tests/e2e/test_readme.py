"""The README's quick start runs as written, on a transformers export saved as bert.onnx."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _quick_start() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    using = text[text.index("## Using it"):]
    return re.search(r"```python\n(.*?)```", using, re.S).group(1)


@pytest.mark.slow
def test_the_quick_start_runs_as_written_on_an_hf_export(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    import torch
    import transformers

    from tvmdm.models import hf_export

    config = hf_export.config("bert")
    config.max_position_embeddings = 512  # BERT's: the quick start binds seq 128
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    hf_export.export("bert", str(tmp_path / "bert.onnx"), dynamo=False, dynamic=True, opset=17, model=model)
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(_quick_start(), "README.md", "exec"), scope)
    assert "check vs onnxruntime" in capsys.readouterr().out and scope["compiled"].check(scope["inputs"]).ok
    assert [s.shape for s in scope["bound"].inputs] == [(8, 128)] * 3
    assert (tmp_path / "bert.tvmdm").is_file()
