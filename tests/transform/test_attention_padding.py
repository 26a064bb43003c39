"""Symbolic sequences padded to whole vectors of keys around SM and the context contraction
(tvmdm.transform.attention_padding), against onnxruntime at lengths that are and are not multiples."""
import pytest

import tvmdm
from tvmdm.models import BertConfig, build_encoder_layer
from tvmdm.transform.attention_kernel import ATTENTION_KERNEL
from tvmdm.transform.attention_padding import KEY_MULTIPLE

SMALL = BertConfig(hidden=128, heads=2, ffn=256)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_a_symbolic_layer_pads_its_keys_and_matches_onnxruntime_at_every_length(layout):
    compiled = tvmdm.compile(build_encoder_layer(SMALL), fusion="paper", layout=layout, tuning_logs=[])
    assert [k for k in compiled.kernels if k.startswith("pad_keys")]
    for kernel in ("sm", "attention_context"):
        func = compiled.mod[kernel]
        assert any(getattr(p, "name", "") == "blocks" and not getattr(p, "shape", None) for p in func.params)
        script = func.script()
        # whole tiles: blocks * 16 keys and rows, register accumulators, no guarded partial tile
        assert f"blocks * T.int64({KEY_MULTIPLE})" in script and '"local"' in script and "T.where" not in script
    for batch, seq in [(2, 16), (1, 7), (3, 45)]:
        feeds = tvmdm.random_inputs(compiled, batch=batch, seq=seq)
        feeds["attention_mask"][0, seq // 2:] = 0  # masked real keys beside the padded ones
        if batch > 1:
            feeds["attention_mask"][1, :] = 0  # every real key masked: the padded ones must still get nothing
        result = compiled.check(feeds)
        assert result.ok, f"({batch}, {seq}): {result}"


def test_concrete_lengths_are_left_alone():
    compiled = tvmdm.compile(build_encoder_layer(SMALL), shapes={"hidden_states": [2, 20, 128],
                                                                  "attention_mask": [2, 20]}, tuning_logs=[])
    assert not [k for k in compiled.kernels if k.startswith(("pad_keys", "cut_keys"))]
    assert all(getattr(p, "name", "") != "blocks" for p in compiled.mod[ATTENTION_KERNEL].params)
    feeds = tvmdm.random_inputs(compiled, batch=2, seq=20)
    assert compiled.check(feeds).ok


def test_padded_keys_give_sm_its_two_vector_register_tile_on_avx512():
    # blocks * 32 keys: SM's register tile of 8 rows x 2 vectors of 16 keys (with 16 it could prove one vector
    # only, 12 % slower); built for the Zen 4 kind, on any machine
    import re

    from tests.helpers.cpu_kinds import BY_NAME

    compiled = tvmdm.compile(build_encoder_layer(SMALL), fusion="paper", target=BY_NAME["zen4"].target(),
                             tuning_logs=[])
    script = compiled.mod["sm"].script()
    assert re.search(r"in T\.unroll\(T\.int64\(2\)\):\n\s*for \w+ in T\.vectorized\(T\.int64\(16\)\)", script)
