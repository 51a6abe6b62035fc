"""GGUF files in: export/checkpoints/gguf_file.py (the bounded reader) and export/checkpoints/gguf.py (a GGUF as a float32 HF
checkpoint). The files are written here with the gguf package's own writer, laid out as llama.cpp's converter lays
them out (its tensor names, metadata keys and, for llama, its q/k row permutation), from tiny random checkpoints;
what comes back is held to the checkpoint it came from and to transformers' own GGUF loading. Hostile files: exact
errors for the fields a header can lie about, and a fuzzer over a real header."""
from __future__ import annotations

import json
import os
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from export.errors import ExportError
from export.checkpoints.gguf import convert
from export.checkpoints.gguf_file import GGUFFile
from export.checkpoints.random_checkpoint import make_checkpoint

gguf = pytest.importorskip("gguf")

_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
          "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
          "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
          "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
          "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}
# llama.cpp's architecture names and its stacked experts' tensors ([E, rows, inputs]: convert_hf_to_gguf.py stacks
# mlp.experts.N.* per layer)
_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}
_EXPERTS = {"gate_proj.weight": "ffn_gate_exps.weight", "up_proj.weight": "ffn_up_exps.weight",
            "down_proj.weight": "ffn_down_exps.weight"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
TEXTS = ["Hello, world!", "  two spaces\tand a tab\n\nnew lines", "The capital of France is Paris. 1234567",
         "naïve café 東京 😀", "<|im_start|>user\nhi<|im_end|>", "don't we've I'll"]


def _gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k permutation (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(checkpoint: str, path: str, quant: str = "F32", pre: str = "gpt-2", tensor_types: dict = None,
               extra: dict = None) -> dict:
    """The checkpoint as llama.cpp's converter would write it (2-D weights as `quant`: F32, F16, Q8_0, Q4_0, ...;
    `tensor_types`: another type for some, by HF name, as llama-quantize gives the tables theirs; `pre` the pre-tokenizer it
    names: the tiny checkpoints' tokenizers split as GPT-2's; `extra`: more metadata, key -> (value, GGUFValueType))."""
    from safetensors.numpy import load_file

    cfg = json.load(open(os.path.join(checkpoint, "config.json")))
    arch = _ARCH.get(cfg["model_type"], cfg["model_type"])
    weights = {}
    for f in sorted(os.listdir(checkpoint)):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(checkpoint, f)))
    tok = json.load(open(os.path.join(checkpoint, "tokenizer.json")))
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"]: a["content"] for a in tok["added_tokens"]}
    by_id.update(special)
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(cfg["vocab_size"])]
    types = [3 if i in special else 5 if i not in by_id else 1 for i in range(cfg["vocab_size"])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w = gguf.GGUFWriter(path, arch)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], list) else [cfg["eos_token_id"]]
    w.add_eos_token_id(eos[0])
    if len(eos) > 1:  # Llama 3's end of turn, as llama.cpp's converter writes it
        w.add_eot_token_id(eos[1])
    w.add_chat_template(open(os.path.join(checkpoint, "chat_template.jinja")).read())
    tensors = dict(weights)
    if arch in _ARCH.values():  # the experts' keys, and each layer's experts stacked as llama.cpp's converter stacks them
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        for layer in range(cfg["num_hidden_layers"]):
            for proj, gguf_name in _EXPERTS.items():
                names = [f"model.layers.{layer}.mlp.experts.{n}.{proj}" for n in range(cfg["num_experts"])]
                if names[0] in tensors:
                    tensors[f"blk.{layer}.{gguf_name}"] = np.stack([tensors.pop(n) for n in names])
            gate = f"model.layers.{layer}.mlp.shared_expert_gate.weight"
            if gate in tensors:  # [1, H] in HF's, [H] in the file
                tensors[gate] = tensors[gate].reshape(-1)
    for name, value in tensors.items():
        value = value.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            value = _permute(value, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            value = _permute(value, kv)
        kind_name = (tensor_types or {}).get(name, quant)
        if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            kind_name = "F32"  # llama-quantize keeps the routers (ffn_gate_inp*) in float
        gguf_name = name if name.startswith("blk.") else _gguf_name(name)
        if value.ndim >= 2 and kind_name != "F32":
            kind = getattr(gguf.GGMLQuantizationType, kind_name)
            packed = gguf.quants.quantize(value, kind)
            w.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=kind)
        else:
            w.add_tensor(gguf_name, value)
    for key, (value, kind) in (extra or {}).items():
        w.add_key_value(key, value, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    ckpt = make_checkpoint(str(root / "llama"), family="llama", num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=False, seed=3)
    path = str(root / "llama.gguf")
    return ckpt, path, write_gguf(ckpt, path)


def converted_bit_for_bit(ckpt: str, tmp_path) -> dict:
    """`ckpt` written as llama.cpp's F32 GGUF (write_gguf) and read back into an HF folder by export's GGUF tool:
    every tensor bit for bit, none missing or extra. Returns the folder's config."""
    from safetensors.numpy import load_file

    weights = write_gguf(ckpt, str(tmp_path / "m.gguf"))
    config = convert(str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(back) == set(weights)
    for name, value in weights.items():
        assert np.array_equal(back[name], value.astype(np.float32)), name
    return config


@pytest.mark.parametrize("family,kw", [("qwen2", {}), ("qwen3", dict(head_dim=32)), ("llama", {})])
def test_round_trip_to_the_checkpoint(tmp_path, family, kw):
    """checkpoint -> GGUF (as llama.cpp lays it out, F32) -> our HF folder: every tensor bit for bit (the llama q/k
    permutation undone), the config's structure, and the same token ids as the checkpoint's own tokenizer."""
    from tokenizers import Tokenizer

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), family=family, seed=5, **kw)
    config = converted_bit_for_bit(ckpt, tmp_path)
    original = json.load(open(os.path.join(ckpt, "config.json")))
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert config[key] == original[key], key
    assert config["head_dim"] == (kw.get("head_dim") or original["hidden_size"] // original["num_attention_heads"])
    ours = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    theirs = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False).ids
        ids = theirs.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    assert open(tmp_path / "out" / "chat_template.jinja").read() == open(os.path.join(ckpt, "chat_template.jinja")).read()


@pytest.mark.parametrize("family,pre", [("llama", "llama-bpe"), ("qwen2", "qwen2")])
def test_as_transformers_loads_it(tmp_path, family, pre):
    """A GGUF through transformers' own loader (its dequantization, its permutation, its tokenizer, here with Llama 3's
    and Qwen2's split regexes): equal weights (Q8_0 matrices) and equal ids."""
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lite_runtime.tokenizer import FolderTokenizer

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), family=family, tie_word_embeddings=False, seed=3)
    write_gguf(ckpt, str(tmp_path / "q8.gguf"), quant="Q8_0", pre=pre)
    convert(str(tmp_path / "q8.gguf"), str(tmp_path / "out"))
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q8.gguf", dtype=torch.float32)
    theirs = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert set(theirs) == set(back)
    for name, value in back.items():
        assert np.array_equal(theirs[name], value), name
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="q8.gguf")
    ours = FolderTokenizer(str(tmp_path / "out"))
    for text in TEXTS:
        assert ours(text)["input_ids"] == hf_tok(text)["input_ids"], text


def _header(path: str) -> bytes:
    return open(path, "rb").read()


def _patched(data: bytes, offset: int, fmt: str, value) -> bytes:
    return data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt):]


def test_refusals_name_the_file_and_field(llama_gguf, tmp_path):
    _, path, _ = llama_gguf
    data = _header(path)
    cases = {
        "magic": (b"GGML" + data[4:], "not a GGUF file (it does not begin with 'GGUF')"),
        "version": (_patched(data, 4, "<I", 1), "GGUF version 1 is not read; supported: 2, 3"),
        "big-endian": (_patched(data, 4, ">I", 3), "GGUF version 50331648 is not read"),
        "tensor count": (_patched(data, 8, "<Q", 1 << 60), "GGUF tensor count: needs"),
        "metadata count": (_patched(data, 16, "<Q", 1 << 60), "GGUF metadata count: needs"),
        "first key length": (_patched(data, 24, "<Q", 1 << 62), "GGUF metadata key 0: needs"),
        "truncated": (data[:len(data) // 2], "the file is truncated or damaged"),
        "empty": (b"", "GGUF magic: needs 4 bytes, 0 are left"),
    }
    for label, (content, message) in cases.items():
        bad = tmp_path / f"{label.replace(' ', '_')}.gguf"
        bad.write_bytes(content)
        with pytest.raises(ExportError) as err:
            GGUFFile(str(bad))
        text = str(err.value)
        assert text.startswith(str(bad)) and message in text and "\n" not in text, (label, text)
    # a GGUF of another architecture, refused by name before anything is written
    other = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(other), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ExportError, match=r"GGUF architecture 'gpt2' is not supported; supported: llama, qwen2, qwen2moe, qwen3, qwen3moe"):
        convert(str(other), str(tmp_path / "never"))
    assert not os.path.exists(tmp_path / "never")


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """A real GGUF header (the tiny llama's metadata and tensor table) with a little data: what the fuzzer mutates."""
    root = tmp_path_factory.mktemp("fuzz")
    ckpt = make_checkpoint(str(root / "ckpt"), family="llama", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, seed=7)
    path = str(root / "small.gguf")
    write_gguf(ckpt, path, quant="Q8_0")
    return _header(path)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_headers_are_refused_in_one_line(small_gguf, tmp_path, data):
    """Bytes of a real file overwritten with fuzz (anywhere in its header, counts and lengths included) or the file
    cut short: it reads, or it is one ExportError line naming the file; never another exception, a large allocation
    or a long loop (each read is timed)."""
    blob = bytearray(small_gguf)
    header_end = min(len(blob), 40_000)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, header_end - 8))
        blob[at:at + 8] = data.draw(st.binary(min_size=8, max_size=8))
    if data.draw(st.booleans()):
        blob = blob[:data.draw(st.integers(0, len(blob)))]
    path = tmp_path / "fuzzed.gguf"
    path.write_bytes(bytes(blob))
    start = time.monotonic()
    try:
        f = GGUFFile(str(path))
        for t in f.tensors[:3]:
            f.dequantized(t)
    except ExportError as exc:
        assert str(exc).startswith(str(path)) and "\n" not in str(exc)
    assert time.monotonic() - start < 5.0


def _export(checkpoint: str, output: str, **kw) -> str:
    from export.config import ExportConfig
    from export.pipeline import run_export

    run_export(ExportConfig(checkpoint=checkpoint, output=output, name="m", seq_length=32, batch_size=1,
                            dtype=kw.pop("dtype", "float32"), device="cpu", **kw))
    return output


def test_export_from_a_gguf_equals_export_from_its_checkpoint(tmp_path):
    """`--checkpoint model.gguf`: the folder holds the same weights bit for bit and the same golden references as the
    folder exported from the HF checkpoint the GGUF was written from (llama: the permutation undone), and the same
    special ids; its own tokenizer gives the same ids."""
    from lite_runtime.tokenizer import FolderTokenizer

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), family="llama", tie_word_embeddings=False, seed=11)
    write_gguf(ckpt, str(tmp_path / "m.gguf"))
    a = _export(ckpt, str(tmp_path / "from_hf"))
    b = _export(str(tmp_path / "m.gguf"), str(tmp_path / "from_gguf"))
    weights = "m_variables/data_0"
    assert open(os.path.join(a, weights), "rb").read() == open(os.path.join(b, weights), "rb").read()
    golden_a, golden_b = (json.load(open(os.path.join(f, "golden.json"))) for f in (a, b))
    assert golden_a["batches"] == golden_b["batches"]
    import yaml

    infer_a, infer_b = (yaml.safe_load(open(os.path.join(f, "m.yaml")))["infer"] for f in (a, b))
    assert len(infer_a["eos_token_id"]) == 2
    for key in ("eos_token_id", "pad_token_id", "vocab_size", "model_name"):
        assert infer_a[key] == infer_b[key], key
    ours, theirs = FolderTokenizer(b), FolderTokenizer(a)
    for text in TEXTS:
        assert ours(text, add_special_tokens=False)["input_ids"] == theirs(text, add_special_tokens=False)["input_ids"]


def test_a_q8_gguf_folder_passes_check_and_matches_transformers(tmp_path, capsys):
    """A Q8_0 GGUF exported as it comes (dequantized): `check` passes against golden references from the dequantized
    weights, and export.compare, with transformers loading the GGUF itself, finds the same greedy tokens."""
    pytest.importorskip("torch")
    from export.compare import main as compare_main
    from lite_runtime.check import main as check_main

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), family="qwen2", seed=12)
    write_gguf(ckpt, str(tmp_path / "q8.gguf"), quant="Q8_0", pre="gpt-2")
    folder = _export(str(tmp_path / "q8.gguf"), str(tmp_path / "folder"))
    assert check_main([folder, "--backend", "ms", "-q"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS m on backend ms:")
    assert compare_main(["--checkpoint", str(tmp_path / "q8.gguf"), "--model_dir", folder, "-q"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("PASS m on backend ms:") and "greedy tokens identical" in out[-2], out
    assert out[-1].startswith("stored golden references against HF: greedy tokens identical"), out
