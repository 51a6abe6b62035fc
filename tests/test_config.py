"""ModelConfig from HF config.json (every family): fields honoured, features we cannot honour refused by name."""
from __future__ import annotations

import pytest

from export.config import ModelConfig
from export.errors import ExportError

BASE = dict(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
MOE = dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def test_hf_written_config_round_trips(checkpoints):
    import json

    from transformers import AutoConfig

    path = f"{checkpoints['gqa_tied']}/config.json"
    ours, hf = ModelConfig.from_file(path), AutoConfig.from_pretrained(checkpoints["gqa_tied"])
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(hf, field), field
    with open(path) as fh:
        assert ours.rope_theta == json.load(fh)["rope_parameters"]["rope_theta"]


def test_both_rope_layouts_and_unknown_keys():
    old = ModelConfig.from_dict({**BASE, "rope_theta": 1e6, "some_future_key": 1})
    new = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert old.rope_theta == new.rope_theta == 1e6
    assert old.head_dim == 16 and old.kv_groups == 2


def test_head_dim_and_missing_kv_heads_default_to_hf_rules():
    cfg = ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "num_key_value_heads"})
    assert cfg.num_key_value_heads == 4
    assert ModelConfig.from_dict({**BASE, "head_dim": 32}).head_dim == 32


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gemma"}, "config.json: model_type 'gemma' is not supported; supported: qwen2, qwen3, llama, "
                              "qwen3_moe, qwen2_moe"),
    ({"model_type": "mixtral"}, "config.json: model_type 'mixtral' is a mixture-of-experts model of another design, "
                                "which is not supported; supported: qwen2, qwen3, llama, qwen3_moe, qwen2_moe"),
    ({"model_type": "qwen3_moe"}, "config.json: missing field num_experts (a mixture-of-experts config needs it)"),
    ({**MOE, "num_experts_per_tok": 9}, "config.json: num_experts_per_tok (9) is greater than num_experts (8); a "
                                        "token cannot pick more experts than there are"),
    ({**MOE, "mlp_only_layers": [2]},
     "config.json: mlp_only_layers holds 2, not a layer index below num_hidden_layers (2)"),
    ({**MOE, "model_type": "qwen2_moe"},
     "config.json: missing field shared_expert_intermediate_size (a mixture-of-experts config needs it)"),
    ({**MOE, "norm_topk_prob": 1}, "config.json: norm_topk_prob must be true or false, got 1"),
    ({"rope_scaling": {"type": "dynamic", "factor": 4.0}},
     "config.json: rope_scaling type 'dynamic' is not supported: dynamic NTK scaling changes the rotary frequencies "
     "with each sequence's length at run time, which graphs of static shapes cannot; drop rope_scaling or use 'yarn'"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}},
     "config.json: rope_parameters type 'longrope' is not supported: LongRoPE switches between two frequency tables "
     "by sequence length at run time, which graphs of static shapes cannot; drop rope_scaling"),
    ({"rope_parameters": {"rope_type": "su"}},
     "config.json: rope_parameters type 'su' is not supported; supported: default, linear, yarn, llama3"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "config.json: rope_scaling type 'llama3' needs low_freq_factor"),
    ({"rope_scaling": {"type": "linear", "factor": -1}},
     "config.json: rope_scaling.factor must be a positive number, got -1"),
    ({"partial_rotary_factor": 0.5},
     "config.json: partial_rotary_factor 0.5 is not supported; only rotary embeddings over the whole head_dim"),
    ({"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
     "config.json: sliding-window attention on 2 layer(s) with sliding_window None is not supported; export a "
     "checkpoint without use_sliding_window"),
    ({"layer_types": ["full_attention", "chunked_attention"]},
     "config.json: layer_types 'chunked_attention' are not supported; only full_attention and sliding_attention"),
    ({"hidden_act": "gelu"}, "config.json: hidden_act 'gelu' is not supported; only 'silu'"),
    ({"model_type": "llama", "attention_bias": "yes"}, "config.json: attention_bias must be true or false, got 'yes'"),
    ({"num_key_value_heads": 3},
     "config.json: num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    ({"hidden_size": 0}, "config.json: hidden_size must be a positive integer, got 0"),
    ({"vocab_size": None}, "config.json: vocab_size must be a positive integer, got None"),
])
def test_refused_by_name(change, message):
    with pytest.raises(ExportError) as err:
        ModelConfig.from_dict({**BASE, **change})
    assert str(err.value) == message


def test_missing_fields_are_listed():
    raw = {k: v for k, v in BASE.items() if k not in ("hidden_size", "vocab_size")}
    with pytest.raises(ExportError) as err:
        ModelConfig.from_dict(raw)
    assert str(err.value) == "config.json: missing field(s) vocab_size, hidden_size"


def test_rope_scaling_in_both_layouts_reads_the_same():
    """Hub checkpoints carry rope_theta + rope_scaling (`type` or `rope_type`); transformers 5 writes rope_parameters."""
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32768}
    old = ModelConfig.from_dict({**BASE, "rope_theta": 1e6, "rope_scaling": {"type": "yarn", **yarn}})
    mid = ModelConfig.from_dict({**BASE, "rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", **yarn}})
    new = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, **yarn}})
    assert old == mid == new
    assert new.rope_theta == 1e6 and new.rope_scaling == {"rope_type": "yarn", **yarn}
    # yarn without original_max_position_embeddings: transformers takes max_position_embeddings
    bare = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    assert bare.rope_scaling["original_max_position_embeddings"] == 256


@pytest.mark.parametrize("model_type, extra, flags", [
    ("qwen2", {}, (True, False, False, False)),
    ("qwen3", {}, (False, False, False, True)),
    ("qwen3", {"attention_bias": True}, (True, True, False, True)),
    ("llama", {}, (False, False, False, False)),
    ("llama", {"attention_bias": True, "mlp_bias": True}, (True, True, True, False)),
])
def test_family_structure(model_type, extra, flags):
    cfg = ModelConfig.from_dict({**BASE, "model_type": model_type, **extra})
    assert (cfg.qkv_bias, cfg.o_proj_bias, cfg.mlp_bias, cfg.qk_norm) == flags


def test_sliding_window_is_accepted_only_where_it_changes_nothing():
    from export.config import ExportConfig

    sliding = {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}
    assert ModelConfig.from_dict({**BASE, **sliding}).sliding_window == 64
    # every layer below max_window_layers: nothing slides
    assert ModelConfig.from_dict({**BASE, **sliding, "max_window_layers": 2}).sliding_window is None
    cfg = ModelConfig.from_dict({**BASE, **sliding})
    ExportConfig(checkpoint="c", output="o", name="n", seq_length=64, device="cpu").validate(cfg, ("float32",))
    with pytest.raises(ExportError) as err:
        ExportConfig(checkpoint="c", output="o", name="n", seq_length=65, device="cpu").validate(cfg, ("float32",))
    assert str(err.value) == ("--seq_length 65: config.json has sliding-window attention (use_sliding_window, "
                              "sliding_window 64), which is not supported beyond the window; pass --seq_length 64 "
                              "or less, where sliding changes nothing")
