"""Qwen2Config from HF config.json: fields honoured, features we cannot honour refused by name."""
from __future__ import annotations

import pytest

from export.config import Qwen2Config
from export.errors import ExportError

BASE = dict(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def test_hf_written_config_round_trips(checkpoints):
    import json

    from transformers import AutoConfig

    path = f"{checkpoints['gqa_tied']}/config.json"
    ours, hf = Qwen2Config.from_file(path), AutoConfig.from_pretrained(checkpoints["gqa_tied"])
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(hf, field), field
    with open(path) as fh:
        assert ours.rope_theta == json.load(fh)["rope_parameters"]["rope_theta"]


def test_both_rope_layouts_and_unknown_keys():
    old = Qwen2Config.from_dict({**BASE, "rope_theta": 1e6, "some_future_key": 1})
    new = Qwen2Config.from_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert old.rope_theta == new.rope_theta == 1e6
    assert old.head_dim == 16 and old.kv_groups == 2


def test_head_dim_and_missing_kv_heads_default_to_hf_rules():
    cfg = Qwen2Config.from_dict({k: v for k, v in BASE.items() if k != "num_key_value_heads"})
    assert cfg.num_key_value_heads == 4
    assert Qwen2Config.from_dict({**BASE, "head_dim": 32}).head_dim == 32


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "config.json: model_type 'llama' is not supported; supported: qwen2"),
    ({"use_sliding_window": True},
     "config.json: use_sliding_window=true is not supported; export a checkpoint with use_sliding_window=false"),
    ({"layer_types": ["full_attention", "sliding_attention"]},
     "config.json: use_sliding_window=true is not supported; export a checkpoint with use_sliding_window=false"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}},
     "config.json: rope_scaling {'type': 'yarn', 'factor': 4.0} is not supported; only default rotary embeddings"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "config.json: rope_parameters.rope_type 'yarn' is not supported; only 'default'"),
    ({"hidden_act": "gelu"}, "config.json: hidden_act 'gelu' is not supported; only 'silu'"),
    ({"num_key_value_heads": 3},
     "config.json: num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    ({"hidden_size": 0}, "config.json: hidden_size must be a positive integer, got 0"),
    ({"vocab_size": None}, "config.json: vocab_size must be a positive integer, got None"),
])
def test_refused_by_name(change, message):
    with pytest.raises(ExportError) as err:
        Qwen2Config.from_dict({**BASE, **change})
    assert str(err.value) == message


def test_missing_fields_are_listed():
    raw = {k: v for k, v in BASE.items() if k not in ("hidden_size", "vocab_size")}
    with pytest.raises(ExportError) as err:
        Qwen2Config.from_dict(raw)
    assert str(err.value) == "config.json: missing field(s) vocab_size, hidden_size"
