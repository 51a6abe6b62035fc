"""Export at real sizes: a random checkpoint of a real Qwen2 shape, our export and llama.cpp's converter side by side.

    python benchmarks/bench_export.py --shape qwen2-7b [--layers N] [--tp_size 8] [--export "--device cpu ..."]
           [--llama_cpp] [--llama_quantize Q8_0,Q4_0] [--drop_caches] [--json FILE] [--work_dir DIR]

1. Writes a random bfloat16 checkpoint in the shape (`--layers` cuts the depth), shard by shard (2 GiB shards,
   each tensor generated and written in chunks: memory stays at a chunk whatever the shape), with config.json,
   generation_config.json and a small tokenizer trained on the spot. Kept in the work folder for later runs.
2. Runs `python -m export -q -v` on it (the default Atlas export unless `--export` says otherwise; each `--export`
   is one run), and, with `--llama_cpp`, llama.cpp's own converter (convert_hf_to_gguf.py --outtype f16, from the
   llama-cpp-python sdist's vendored source: benchmarks/llama_cpp.py).
3. Samples every 0.1 s, for each run: the anonymous memory of the process tree (RssAnon summed; the page cache
   and the checkpoint's mapped pages are not the run's to keep) and the used bytes of the output's file system.
   Reports wall time, peak anonymous memory, peak disk (used bytes above the start) and the output's size,
   overall and per stage of our export (its -v log names each stage as it starts). Beside them: the bytes under
   the output path itself (peak_output_gib: what the file system's count holds of this run alone, when other
   processes write to the same disk), the CPU seconds of the run's process tree, and the CPU seconds the rest of
   the machine used meanwhile (other_cpu_seconds: how far the wall time is the run's own on a shared machine).
4. Each folder's weights by kind before it is deleted (linear layers with their scales and offsets, embedding and
   head, biases, norms, KV cache), read from its graph's parameters, with bytes per checkpoint parameter; for a
   quantized folder, each kind's size per rank of the 72B shape at tensor parallel 2, 4 and 8 from those bytes.
5. With `--llama_quantize Q8_0,Q4_0` (needs `--llama_cpp`), llama.cpp's `llama-quantize` (built once with cmake
   into <work_dir>/llama-build from the same vendored source) on the f16 GGUF to each type, measured the same way,
   with each GGUF's tensors by kind and type (gguf's reader), and each of our folders against the GGUF of the same
   bits (bf16/fp16 against F16, int8 against Q8_0, int4 against Q4_0).
`--drop_caches` empties the page cache before each run (needs root), so every run reads the checkpoint cold.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # llama_cpp.py, beside this file
sys.path.insert(0, ROOT)

from lite_runtime.memory import anon_bytes  # noqa: E402  (the repository root is on the path from here)

SHAPES: Dict[str, Dict[str, Any]] = {  # the released configs' sizes (Qwen/Qwen2-*: config.json)
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2-72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    # Qwen/Qwen3-30B-A3B: a mixture of experts (every layer sparse, 8 of 128 experts a token), q/k norms, no biases
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True),
}
SHARD_BYTES = 2 << 30
CHUNK_ELEMENTS = 16 << 20


def say(text: str) -> None:
    print(f"[bench_export] {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- 1. the checkpoint

def tensors(shape: Dict[str, Any]):
    """(HF name, shape, (mean, std)) of every tensor of a Qwen2 checkpoint (or a Qwen3-MoE one: q/k norms, no biases,
    each layer's router and experts), in module order."""
    e, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    h, kh = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape.get("head_dim", e // h)
    qwen3 = shape.get("model_type", "qwen2").startswith("qwen3")
    yield "model.embed_tokens.weight", (v, e), (0.0, 0.1)
    for n in range(shape["num_hidden_layers"]):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", (e,), (1.0, 0.1)
        for name, out, inp in (("q_proj", h * d, e), ("k_proj", kh * d, e), ("v_proj", kh * d, e)):
            yield p + f"self_attn.{name}.weight", (out, inp), (0.0, inp ** -0.5)
            if not qwen3:
                yield p + f"self_attn.{name}.bias", (out,), (0.0, 0.1)
        yield p + "self_attn.o_proj.weight", (e, h * d), (0.0, (h * d) ** -0.5)
        if qwen3:
            yield p + "self_attn.q_norm.weight", (d,), (1.0, 0.1)
            yield p + "self_attn.k_norm.weight", (d,), (1.0, 0.1)
        yield p + "post_attention_layernorm.weight", (e,), (1.0, 0.1)
        if shape.get("num_experts"):
            mi = shape["moe_intermediate_size"]
            yield p + "mlp.gate.weight", (shape["num_experts"], e), (0.0, e ** -0.5)
            for x in range(shape["num_experts"]):
                yield p + f"mlp.experts.{x}.gate_proj.weight", (mi, e), (0.0, e ** -0.5)
                yield p + f"mlp.experts.{x}.up_proj.weight", (mi, e), (0.0, e ** -0.5)
                yield p + f"mlp.experts.{x}.down_proj.weight", (e, mi), (0.0, mi ** -0.5)
            continue
        yield p + "mlp.gate_proj.weight", (i, e), (0.0, e ** -0.5)
        yield p + "mlp.up_proj.weight", (i, e), (0.0, e ** -0.5)
        yield p + "mlp.down_proj.weight", (e, i), (0.0, i ** -0.5)
    yield "model.norm.weight", (e,), (1.0, 0.1)
    if not shape["tie_word_embeddings"]:
        yield "lm_head.weight", (v, e), (0.0, e ** -0.5)


def _bf16_chunks(shape, mean: float, std: float, rng) -> "iter":
    """The tensor's values as bfloat16 bits, CHUNK_ELEMENTS at a time: uniform with the given mean and std."""
    total = int(np.prod(shape))
    half_width = np.float32(std * 3 ** 0.5)
    for start in range(0, total, CHUNK_ELEMENTS):
        n = min(CHUNK_ELEMENTS, total - start)
        values = rng.random(n, dtype=np.float32)
        values *= 2 * half_width
        values += np.float32(mean) - half_width
        bits = values.view(np.uint32)
        bits += np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))  # round to nearest even
        yield (bits >> np.uint32(16)).astype(np.uint16)


def _start_checkpoint(folder: str, shape: Dict[str, Any], dtype: str, quantization: Optional[Dict[str, Any]] = None):
    """A new checkpoint folder's config.json (the shape; `quantization`: its quantization_config), generation config
    and tokenizer."""
    from transformers import AutoConfig, GenerationConfig

    from export.checkpoints.random_checkpoint import build_tokenizer

    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    fields = {k: v for k, v in shape.items() if k != "model_type"}
    cfg = AutoConfig.for_model(shape.get("model_type", "qwen2"), max_position_embeddings=32768, rms_norm_eps=1e-6,
                               bos_token_id=eos, eos_token_id=eos,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                               use_sliding_window=False, dtype=dtype, **fields)
    cfg.save_pretrained(folder)
    if quantization is not None:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as fh:
            raw = json.load(fh)
        raw["quantization_config"] = quantization
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as fh:
            json.dump(raw, fh, indent=2)
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


_SIZE_OF = {"BF16": 2, "F16": 2, "I32": 4}


def _write_shards(folder: str, entries, seed: int, what: str) -> None:
    """Safetensors shards of at most SHARD_BYTES from `entries` (name, dims, safetensors dtype, chunks(rng): the
    tensor's values chunk by chunk), their index, and the `.complete` mark."""
    shards: List[List[tuple]] = [[]]
    size = 0
    for entry in entries:
        nbytes = int(np.prod(entry[1])) * _SIZE_OF[entry[2]]
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    start = time.perf_counter()
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dims, dtype, _ in shard:
            nbytes = int(np.prod(dims)) * _SIZE_OF[dtype]
            header[name] = {"dtype": dtype, "shape": list(dims), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(os.path.join(folder, fname), "wb") as fh:
            fh.write(len(text).to_bytes(8, "little") + text)
            for name, _, _, chunks in shard:
                for chunk in chunks(rng):
                    fh.write(chunk.tobytes())
                weight_map[name] = fname
        total += offset
        say(f"{what} shard {k}/{len(shards)} written ({total / 2**30:.1f} GiB, {time.perf_counter() - start:.0f} s)")
    with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)
    open(os.path.join(folder, ".complete"), "w").close()


def _shape(shape_name: str, layers: Optional[int]) -> Dict[str, Any]:
    shape = dict(SHAPES[shape_name])
    if layers:
        shape["num_hidden_layers"] = layers
    return shape


def write_checkpoint(folder: str, shape_name: str, layers: Optional[int], seed: int = 0) -> str:
    """A random bf16 checkpoint of the shape in `folder` (written once: an existing complete one is reused)."""
    if os.path.isfile(os.path.join(folder, ".complete")):
        return folder
    shape = _shape(shape_name, layers)
    _start_checkpoint(folder, shape, "bfloat16")
    entries = ((name, dims, "BF16", (lambda d, m, s: lambda rng: _bf16_chunks(d, m, s, rng))(dims, mean, std))
               for name, dims, (mean, std) in tensors(shape))
    _write_shards(folder, entries, seed, "checkpoint")
    return folder


_GPTQ_LINEAR = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight$")


def _gptq_tensors(shape: Dict[str, Any], bits: int, group: int):
    """(name, dims, safetensors dtype, chunks(rng)) of a random GPTQ checkpoint of the shape, as Qwen's GPTQ releases
    hold it: each linear layer (experts each alone) as qweight int32 [in / (32 / bits), out], qzeros int32
    [groups, out / (32 / bits)] (symmetric: every zero 2^(bits-1), stored minus one), scales float16 [groups, out],
    g_idx int32 [in]; everything else (embeddings, norms, the routers, lm_head) float16."""
    per = 32 // bits
    zero_word = 0
    for k in range(per):
        zero_word |= ((1 << (bits - 1)) - 1) << (bits * k)

    def words(n):
        return lambda rng: (np.frombuffer(rng.bytes(4 * m), np.uint32) for m in _spans(n))

    def const(n, value, dtype):
        return lambda rng: (np.full(m, value, dtype) for m in _spans(n))

    def half(n, mean, std):
        return lambda rng: ((rng.random(m, dtype=np.float32) * 2 - 1) * np.float32(std * 3 ** 0.5) + np.float32(mean)
                            for m in _spans(n))

    for name, dims, (mean, std) in tensors(shape):
        if not _GPTQ_LINEAR.search(name):
            yield name, dims, "F16", (lambda n, a, b: (lambda rng: (c.astype(np.float16) for c in half(n, a, b)(rng))))(
                int(np.prod(dims)), mean, std)
            continue
        out, inp = dims
        layer, groups = name[:-len(".weight")], inp // group
        step = std * 3 ** 0.5 / (1 << (bits - 1))  # the uniform weights' range over the integers
        yield layer + ".qweight", (inp // per, out), "I32", words(inp // per * out)
        yield layer + ".qzeros", (groups, out // per), "I32", const(groups * out // per, zero_word, np.uint32)
        yield layer + ".scales", (groups, out), "F16", (lambda n, a: (
            lambda rng: (c.astype(np.float16) for c in half(n, a, a * 0.2)(rng))))(groups * out, step)
        yield layer + ".g_idx", (inp,), "I32", (lambda n: (lambda rng: (
            (np.arange(a, a + m) // group).astype(np.int32) for a, m in _offsets(n))))(inp)


def _spans(n: int):
    for _, m in _offsets(n):
        yield m


def _offsets(n: int):
    for a in range(0, n, CHUNK_ELEMENTS):
        yield a, min(CHUNK_ELEMENTS, n - a)


def write_gptq_checkpoint(folder: str, shape_name: str, layers: Optional[int], bits: int = 4, group: int = 128,
                          seed: int = 0) -> str:
    """A random GPTQ-Int<bits> checkpoint of the shape in `folder`, shard by shard (an existing complete one is
    reused): what export reads from Qwen's GPTQ releases, at their size, without quantizing anything."""
    if os.path.isfile(os.path.join(folder, ".complete")):
        return folder
    shape = _shape(shape_name, layers)
    _start_checkpoint(folder, shape, "float16", {"quant_method": "gptq", "bits": bits, "group_size": group,
                                                 "sym": True, "desc_act": False, "checkpoint_format": "gptq"})
    _write_shards(folder, _gptq_tensors(shape, bits, group), seed, "GPTQ checkpoint")
    return folder


# ---------------------------------------------------------------- 2. measuring a command

def _tree(pid: int) -> List[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children", encoding="ascii") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except OSError:
            pass
    return pids


def _anon_bytes(pids: List[int]) -> int:
    return sum(anon_bytes(p) for p in pids)


def _used_bytes(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def _busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot (/proc/stat: every state but idle and iowait)."""
    with open("/proc/stat", encoding="ascii") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _path_bytes(output: str) -> int:
    """Bytes allocated under `output` and its siblings named after it (the export's .<name>.partial-<pid>
    folder, a converter's <file>.partial)."""
    parent, base = os.path.split(os.path.abspath(output))
    total = 0
    try:
        names = [n for n in os.listdir(parent) if n == base or n.startswith(base + ".") or n.startswith("." + base)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(parent, name)
        walk = [(parent, [], [name])] if not os.path.isdir(path) else os.walk(path)
        for root, _, files in walk:
            for f in files:
                try:
                    total += os.lstat(os.path.join(root, f)).st_blocks * 512
                except OSError:
                    pass
    return total


def measure(cmd: List[str], disk_path: str, env=None, stage_pattern: Optional[str] = None,
            output: Optional[str] = None) -> Dict[str, Any]:
    """Run `cmd`, sampling its tree's anonymous memory and the used bytes of `disk_path`'s file system (and the
    bytes under `output`, when given).

    stage_pattern: a regex whose group 1 names a stage in a line of the command's stderr; samples are then
    also attributed to the stage last named."""
    base = _used_bytes(disk_path)
    cpu0, busy0, load0 = _children_cpu_seconds(), _busy_cpu_seconds(), os.getloadavg()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stages: List[List[Any]] = [["start", 0.0, 0, 0]]  # name, start s, peak anon, peak disk
    peak = {"anon": 0, "disk": 0, "output": 0}
    err_lines: List[str] = []

    def read_err() -> None:
        for line in proc.stderr:
            err_lines.append(line)
            found = re.search(stage_pattern, line) if stage_pattern else None
            if found:
                stages.append([found.group(1), time.perf_counter() - start, 0, 0])

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    out_chunks: List[str] = []
    out_reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
    out_reader.start()
    while proc.poll() is None:
        anon, disk = _anon_bytes(_tree(proc.pid)), _used_bytes(disk_path) - base
        peak["anon"], peak["disk"] = max(peak["anon"], anon), max(peak["disk"], disk)
        if output:
            peak["output"] = max(peak["output"], _path_bytes(output))
        stages[-1][2], stages[-1][3] = max(stages[-1][2], anon), max(stages[-1][3], disk)
        time.sleep(0.1)
    out_reader.join()
    out = "".join(out_chunks)
    reader.join()
    wall = time.perf_counter() - start
    cpu = _children_cpu_seconds() - cpu0
    result = {"cmd": " ".join(shlex.quote(c) for c in cmd), "returncode": proc.returncode,
              "seconds": round(wall, 1), "peak_anon_gib": round(peak["anon"] / 2**30, 2),
              "peak_disk_gib": round(peak["disk"] / 2**30, 2), "stdout": out.strip().splitlines()[-12:],
              "stderr_tail": [line.rstrip() for line in err_lines[-5:]],
              "cpu_seconds": round(cpu, 1), "other_cpu_seconds": round(max(0.0, _busy_cpu_seconds() - busy0 - cpu), 1),
              "loadavg_1min": [round(load0[0], 2), round(os.getloadavg()[0], 2)]}
    if output:
        result["peak_output_gib"] = round(peak["output"] / 2**30, 2)
    if stage_pattern:
        ends = [s[1] for s in stages[1:]] + [wall]
        result["stages"] = [{"stage": s[0], "seconds": round(end - s[1], 1), "peak_anon_gib": round(s[2] / 2**30, 2),
                             "peak_disk_gib": round(s[3] / 2**30, 2)} for s, end in zip(stages, ends)]
    return result


def folder_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def run_ours(checkpoint: str, output: str, extra: List[str], cold: bool) -> Dict[str, Any]:
    shutil.rmtree(output, ignore_errors=True)
    if cold and not drop_caches():
        say("--drop_caches needs root; the page cache stays as it is")
    cmd = [sys.executable, "-m", "export", "-q", "-v", "--checkpoint", checkpoint, "--output", output, *extra]
    say("running " + " ".join(shlex.quote(c) for c in cmd[1:]))
    result = measure(cmd, os.path.dirname(output), stage_pattern=r"INFO export\.pipeline: stage (\w+)",
                     output=output)
    result["output_gib"] = round(folder_bytes(output) / 2**30, 2) if os.path.exists(output) else None
    if result["output_gib"]:
        result["output_bytes"] = folder_bytes(output)
        result["peak_disk_over_output"] = round(result["peak_disk_gib"] / result["output_gib"], 3)
        result["peak_output_over_output"] = round(result["peak_output_gib"] * 2**30 / result["output_bytes"], 3)
    say(f"ours: {result['seconds']} s, exit {result['returncode']}, peak anon {result['peak_anon_gib']} GiB, "
        f"peak disk {result['peak_disk_gib']} GiB, folder {result['output_gib']} GiB")
    return result


def run_check(folder: str, cold: bool) -> Dict[str, Any]:
    if cold:
        drop_caches()
    cmd = [sys.executable, "-m", "lite_runtime.check", folder, "--backend", "ms", "-q"]
    say(f"running python -m lite_runtime.check {folder}")
    result = measure(cmd, os.path.dirname(folder))
    weights = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs
                  if f.startswith("data_"))
    result["weights_gib"] = round(weights / 2**30, 2)
    result["verdict"] = result["stdout"][-1] if result["stdout"] else ""
    say(f"check: {result['seconds']} s, exit {result['returncode']}, peak anon {result['peak_anon_gib']} GiB "
        f"(weights {result['weights_gib']} GiB): {result['verdict'][:120]}")
    return result


def run_llama_cpp(checkpoint: str, output: str, cold: bool, llama_work: Optional[str] = None) -> Dict[str, Any]:
    import llama_cpp

    try:
        src = llama_cpp.source_dir(llama_work or llama_cpp.DEFAULT_WORK)
        llama_cpp.converter_dependencies()
    except llama_cpp.Skip as exc:
        return {"skipped": str(exc)}
    if os.path.exists(output):
        os.remove(output)
    if cold:
        drop_caches()
    cmd, env = llama_cpp.converter_command(src, checkpoint, "f16", output)
    say(f"running llama.cpp's convert_hf_to_gguf.py --outtype f16 on {checkpoint}")
    result = measure(cmd, os.path.dirname(output), env=env, output=output)
    result["cmd"] = f"convert_hf_to_gguf.py {checkpoint} --outtype f16 --outfile {output}"
    result["source"] = src
    result["output_gib"] = round(folder_bytes(output) / 2**30, 2) if os.path.exists(output) else None
    if result["output_gib"]:
        result["output_bytes"] = os.path.getsize(output)
    say(f"llama.cpp: {result['seconds']} s, exit {result['returncode']}, peak anon {result['peak_anon_gib']} GiB, "
        f"peak disk {result['peak_disk_gib']} GiB, GGUF {result['output_gib']} GiB")
    return result


# ---------------------------------------------------------------- 4. what a folder or a GGUF holds, by kind

KINDS = ("linear", "tables", "bias", "norm", "kv_cache", "generated")


def _kind(name: str) -> str:
    """The kind of an HF-named checkpoint tensor or folder parameter (a quantized layer's scale and offset are its
    layer's kind)."""
    if name.endswith(("key_cache", "value_cache")):
        return "kv_cache"
    base = re.sub(r"_(scale|offset)$", "", name)
    if base in ("model.embed_tokens.weight", "lm_head.weight"):
        return "tables"
    if base.endswith(".bias"):
        return "bias"
    if "norm" in base:
        return "norm"
    if base.startswith("model.layers.") and (base.endswith(("_proj.weight", "mlp.gate.weight"))
                                             or ".mlp.experts." in base):  # a MoE's router and (stacked) experts
        return "linear"
    return "generated"


def checkpoint_params(shape: Dict[str, Any]) -> Dict[str, int]:
    """Parameters of each kind in a checkpoint of the shape."""
    counts = {k: 0 for k in KINDS}
    for name, dims, _ in tensors(shape):
        counts[_kind(name)] += int(np.prod(dims))
    return counts


def folder_breakdown(folder: str, params: Dict[str, int]) -> Dict[str, Any]:
    """Rank 0's weights file by kind, from its graph's parameters (MindIR external data: name, dtype, length), with
    the bytes per checkpoint parameter of each kind; the rest of the folder (graphs, tokenizer, golden, padding)."""
    from mindspore.train import mind_ir_pb2

    with open(os.path.join(folder, "manifest.json"), encoding="utf-8") as fh:
        manifest = json.load(fh)
    graph = next(g for g in manifest["graphs"] if g.get("rank", 0) == 0)
    model = mind_ir_pb2.ModelProto()
    with open(os.path.join(folder, graph["file"]), "rb") as fh:
        model.ParseFromString(fh.read())
    type_name = mind_ir_pb2.TensorProto.DataType.Name
    kinds: Dict[str, Dict[str, Any]] = {k: {"bytes": 0, "tensors": {}} for k in KINDS}
    for param in model.graph.parameter:
        name = param.name.rsplit(":", 1)[-1]
        kind = kinds[_kind(name)]
        kind["bytes"] += param.external_data.length
        part = "offset" if name.endswith("_offset") else "scale" if name.endswith("_scale") else "values"
        key = f"{part} {type_name(param.data_type).lower()}"
        kind["tensors"][key] = kind["tensors"].get(key, 0) + param.external_data.length
    weights = os.path.join(folder, graph["variables"])
    for k, kind in kinds.items():
        kind["gib"] = round(kind["bytes"] / 2**30, 3)
        if params.get(k):
            kind["bytes_per_param"] = round(kind["bytes"] / params[k], 5)
    listed = sum(kind["bytes"] for kind in kinds.values())
    files = {g["variables"] for g in manifest["graphs"] if g.get("variables")}
    return {"rank0_weights_file_bytes": os.path.getsize(weights), "alignment_padding_bytes":
            os.path.getsize(weights) - listed, "other_files_bytes": folder_bytes(folder) - sum(
                os.path.getsize(os.path.join(folder, f)) for f in files), "kinds": kinds}


def _gguf_kind(name: str) -> str:
    if name in ("token_embd.weight", "output.weight"):
        return "tables"
    if name.endswith(".bias"):
        return "bias"
    if "norm" in name:
        return "norm"
    if name.startswith("blk."):
        return "linear"
    return "generated"


def gguf_breakdown(path: str, params: Dict[str, int]) -> Dict[str, Any]:
    """A GGUF's tensors by kind and by type (gguf's reader): bytes, bytes per checkpoint parameter, and each
    named table's type (token_embd, output)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    kinds: Dict[str, Dict[str, Any]] = {}
    tables = {}
    for t in reader.tensors:
        kind = kinds.setdefault(_gguf_kind(t.name), {"bytes": 0, "types": {}})
        kind["bytes"] += int(t.n_bytes)
        kind["types"][t.tensor_type.name] = kind["types"].get(t.tensor_type.name, 0) + 1
        if t.name in ("token_embd.weight", "output.weight"):
            tables[t.name] = t.tensor_type.name
    for k, kind in kinds.items():
        kind["gib"] = round(kind["bytes"] / 2**30, 3)
        if params.get(k):
            kind["bytes_per_param"] = round(kind["bytes"] / params[k], 5)
    tensor_bytes = sum(kind["bytes"] for kind in kinds.values())
    return {"file_bytes": os.path.getsize(path), "metadata_and_padding_bytes": os.path.getsize(path) - tensor_bytes,
            "tables": tables, "kinds": kinds}


def plan_per_rank(breakdown: Dict[str, Any], shape: Dict[str, Any], tp_sizes=(2, 4, 8)) -> Dict[str, Any]:
    """Each rank's weights for `shape` at each tensor-parallel size, from the measured bytes per parameter of each
    kind: (P_linear * b_linear + P_tables * b_tables + P_bias * b_bias) / tp + P_norm * b_norm (linear layers split
    by outputs or inputs, the embedding and head by vocabulary, q/k/v biases by heads; norms on every rank). The KV
    cache the folder holds for its --seq_length is left out: the runtime's share, set by the serving batch."""
    params = checkpoint_params(shape)
    per_kind = {k: params[k] * breakdown["kinds"][k].get("bytes_per_param", 0) for k in ("linear", "tables", "bias",
                                                                                          "norm")}
    out = {"params": params, "total_gib": round(sum(per_kind.values()) / 2**30, 2), "per_rank_gib": {}}
    for tp in tp_sizes:
        split = per_kind["linear"] + per_kind["tables"] + per_kind["bias"]
        out["per_rank_gib"][str(tp)] = round((split / tp + per_kind["norm"]) / 2**30, 2)
    return out


# ---------------------------------------------------------------- 5. llama-quantize

def build_llama_quantize(src: str, build: str) -> str:
    """llama.cpp's llama-quantize, built once with cmake into `build` from the vendored source `src` (Release,
    static, GGML_NATIVE: as benchmarks/llama_cpp.py builds llama-bench)."""
    import llama_cpp

    binary = os.path.join(build, "bin", "llama-quantize")
    if os.access(binary, os.X_OK):
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise llama_cpp.Skip(f"building llama-quantize needs {tool} (apt-get install cmake g++)")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    steps = (["cmake", "-S", src, "-B", build, *generator, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
              "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF"],
             ["cmake", "--build", build, "--target", "llama-quantize", "-j", str(os.cpu_count() or 2)])
    say(f"building llama-quantize into {build} (minutes)")
    start = time.perf_counter()
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
            raise llama_cpp.Skip(f"{' '.join(cmd[:3])} failed: {tail[0][:300]}")
    if not os.access(binary, os.X_OK):
        raise llama_cpp.Skip(f"the build did not produce {binary}")
    say(f"built llama-quantize in {time.perf_counter() - start:.0f} s")
    return binary


def run_llama_quantize(binary: str, f16: str, qtype: str, params: Dict[str, int], cold: bool) -> Dict[str, Any]:
    """`llama-quantize <f16> <out> <qtype> <threads>` with its defaults, measured; the GGUF's tensors by kind."""
    output = f16[:-len("-f16.gguf")] + f"-{qtype.lower()}.gguf"
    if os.path.exists(output):
        os.remove(output)
    if cold:
        drop_caches()
    cmd = [binary, f16, output, qtype, str(os.cpu_count() or 2)]
    say(f"running llama-quantize {os.path.basename(f16)} {qtype}")
    result = measure(cmd, os.path.dirname(output), output=output)
    result["output_gib"] = round(folder_bytes(output) / 2**30, 3) if os.path.exists(output) else None
    log = result.pop("stdout") + result["stderr_tail"]
    result["stdout_tail"] = log[-4:]
    if result["returncode"] == 0 and os.path.exists(output):
        result["gguf"] = gguf_breakdown(output, params)
        result["output_bytes"] = os.path.getsize(output)
        os.remove(output)
    say(f"llama-quantize {qtype}: {result['seconds']} s, exit {result['returncode']}, peak anon "
        f"{result['peak_anon_gib']} GiB, GGUF {result['output_gib']} GiB")
    return result


_SAME_BITS = {"int8": "Q8_0", "int4": "Q4_0"}


def comparison(doc: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each export against the first (time) and against the GGUF of the same bits (size)."""
    runs = doc["runs"]
    if not runs:
        return []
    first = runs[0]
    ggufs = {"F16": (doc.get("llama_cpp") or {}).get("output_bytes")}
    for q in doc.get("llama_quantize") or []:
        ggufs[q["type"]] = q.get("output_bytes")
    rows = []
    for r in runs:
        found = re.search(r"--quantize[ =](\w+)", r["args"])
        qtype = _SAME_BITS.get(found.group(1) if found else "", "F16")
        row = {"args": r["args"], "seconds": r["seconds"],
               "time_over_first": round(r["seconds"] / first["seconds"], 3),
               "cpu_over_first": round(r["cpu_seconds"] / first["cpu_seconds"], 3) if first.get("cpu_seconds")
               else None,
               "peak_anon_gib": r["peak_anon_gib"], "peak_disk_over_output": r.get("peak_disk_over_output"),
               "peak_output_over_output": r.get("peak_output_over_output"), "output_bytes": r.get("output_bytes"),
               "gguf": qtype, "gguf_bytes": ggufs.get(qtype)}
        if row["output_bytes"] and row["gguf_bytes"]:
            row["output_over_gguf"] = round(row["output_bytes"] / row["gguf_bytes"], 4)
        rows.append(row)
    return rows


def machine() -> Dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    isa = "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags else platform.machine()
    mem = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "isa": isa, "memory_gib": round(mem / 2**20, 1),
            "blas": os.environ.get("OPENBLAS_CORETYPE") or "numpy's OpenBLAS default",
            "date": time.strftime("%Y-%m-%d")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-7b")
    p.add_argument("--layers", type=int, default=None, help="cut the shape to this many layers")
    p.add_argument("--work_dir", default="/work/bench_export", help="checkpoints and outputs (needs the space)")
    p.add_argument("--export", action="append", default=None, metavar="ARGS",
                   help="extra arguments of one export run, e.g. \"--device cpu --seq_length 512\" (repeatable; "
                        "default: one run with none, the default Atlas export)")
    p.add_argument("--gptq", type=int, choices=(4, 8), default=0, metavar="BITS",
                   help="the checkpoint a random GPTQ-Int<BITS> one (groups of 128), as Qwen's GPTQ releases pack it")
    p.add_argument("--llama_cpp", action="store_true", help="also time llama.cpp's converter (f16 GGUF)")
    p.add_argument("--llama_quantize", default="", metavar="TYPES",
                   help="with --llama_cpp: also llama-quantize the f16 GGUF to these types (e.g. Q8_0,Q4_0), each "
                        "measured and listed by tensor kind and type, and compare folder sizes at equal bits")
    p.add_argument("--llama_work", default=None, metavar="DIR",
                   help="where llama.cpp's source is unpacked (default: benchmarks/llama_cpp.py's DEFAULT_WORK)")
    p.add_argument("--drop_caches", action="store_true", help="empty the page cache before each run (root)")
    p.add_argument("--keep", action="store_true", help="keep the exported folders")
    p.add_argument("--check", action="store_true",
                   help="after each export, time python -m lite_runtime.check on the folder (backend ms) the same way")
    p.add_argument("--json", dest="json_path", help="write the results as JSON to this file")
    args = p.parse_args(argv)
    tag = args.shape + (f"-{args.layers}l" if args.layers else "")
    os.makedirs(args.work_dir, exist_ok=True)
    say(f"checkpoint {tag} in {args.work_dir}")
    if args.gptq:
        tag += f"-gptq-int{args.gptq}"
        checkpoint = write_gptq_checkpoint(os.path.join(args.work_dir, f"ckpt-{tag}"), args.shape, args.layers,
                                           args.gptq)
    else:
        checkpoint = write_checkpoint(os.path.join(args.work_dir, f"ckpt-{tag}"), args.shape, args.layers)
    shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    params = checkpoint_params(shape)
    doc: Dict[str, Any] = {"machine": machine(), "command": " ".join(shlex.quote(a) for a in
                                                                      [sys.executable, *sys.argv]),
                           "shape": args.shape, "layers": args.layers,
                           "checkpoint_gib": round(folder_bytes(checkpoint) / 2**30, 2),
                           "checkpoint_params": params, "page_cache": "dropped before each run" if args.drop_caches
                           else "as left (warm)", "runs": []}
    if args.drop_caches and not drop_caches():
        doc["page_cache"] = "as left (warm): --drop_caches needs root"
    if args.llama_cpp:
        gguf = os.path.join(args.work_dir, f"{tag}-f16.gguf")
        doc["llama_cpp"] = run_llama_cpp(checkpoint, gguf, args.drop_caches, args.llama_work)
        if os.path.exists(gguf) and args.llama_quantize:
            import llama_cpp

            doc["llama_cpp"]["gguf"] = gguf_breakdown(gguf, params)
            doc["llama_quantize"] = []
            try:
                binary = build_llama_quantize(doc["llama_cpp"]["source"], os.path.join(args.work_dir, "llama-build"))
            except llama_cpp.Skip as exc:
                doc["llama_quantize"].append({"skipped": str(exc)})
            else:
                for qtype in args.llama_quantize.split(","):
                    result = run_llama_quantize(binary, gguf, qtype, params, args.drop_caches)
                    result["type"] = qtype
                    doc["llama_quantize"].append(result)
        if os.path.exists(gguf):
            os.remove(gguf)
    for extra in args.export or [""]:
        output = os.path.join(args.work_dir, f"out-{tag}")
        result = run_ours(checkpoint, output, shlex.split(extra), args.drop_caches)
        result["args"] = extra
        if result["returncode"] == 0 and os.path.isfile(os.path.join(output, "manifest.json")):
            result["weights"] = folder_breakdown(output, params)
            if "--quantize" in extra and args.shape != "qwen2-72b":
                result["plan_qwen2_72b"] = plan_per_rank(result["weights"], SHAPES["qwen2-72b"])
        if args.check and result["returncode"] == 0:
            result["check"] = run_check(output, args.drop_caches)
        doc["runs"].append(result)
        if not args.keep:
            shutil.rmtree(output, ignore_errors=True)
    doc["comparison"] = comparison(doc)
    print(json.dumps(doc, indent=1))
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
    return 0 if all(r["returncode"] == 0 for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
