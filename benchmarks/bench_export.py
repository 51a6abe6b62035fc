"""Export at real sizes: a random checkpoint of a real Qwen2 shape, our export and llama.cpp's converter side by side.

    python benchmarks/bench_export.py --shape qwen2-7b [--layers N] [--tp_size 8] [--export "--device cpu ..."]
           [--llama_cpp] [--drop_caches] [--json FILE] [--work_dir DIR]

1. Writes a random bfloat16 checkpoint in the shape (`--layers` cuts the depth), shard by shard (2 GiB shards,
   each tensor generated and written in chunks: memory stays at a chunk whatever the shape), with config.json,
   generation_config.json and a small tokenizer trained on the spot. Kept in the work folder for later runs.
2. Runs `python -m export -q -v` on it (the default Atlas export unless `--export` says otherwise; each `--export`
   is one run), and, with `--llama_cpp`, llama.cpp's own converter (convert_hf_to_gguf.py --outtype f16, from the
   llama-cpp-python sdist's vendored source: benchmarks/llama_cpp.py).
3. Samples every 0.1 s, for each run: the anonymous memory of the process tree (RssAnon summed; the page cache
   and the checkpoint's mapped pages are not the run's to keep) and the used bytes of the output's file system.
   Reports wall time, peak anonymous memory, peak disk (used bytes above the start) and the output's size,
   overall and per stage of our export (its -v log names each stage as it starts).
`--drop_caches` empties the page cache before each run (needs root), so every run reads the checkpoint cold.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
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
}
SHARD_BYTES = 2 << 30
CHUNK_ELEMENTS = 16 << 20


def say(text: str) -> None:
    print(f"[bench_export] {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- 1. the checkpoint

def tensors(shape: Dict[str, Any]):
    """(HF name, shape, (mean, std)) of every tensor of a Qwen2 checkpoint, in module order."""
    e, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    h, kh = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = e // h
    yield "model.embed_tokens.weight", (v, e), (0.0, 0.1)
    for n in range(shape["num_hidden_layers"]):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", (e,), (1.0, 0.1)
        for name, out, inp in (("q_proj", h * d, e), ("k_proj", kh * d, e), ("v_proj", kh * d, e)):
            yield p + f"self_attn.{name}.weight", (out, inp), (0.0, inp ** -0.5)
            yield p + f"self_attn.{name}.bias", (out,), (0.0, 0.1)
        yield p + "self_attn.o_proj.weight", (e, h * d), (0.0, (h * d) ** -0.5)
        yield p + "post_attention_layernorm.weight", (e,), (1.0, 0.1)
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


def write_checkpoint(folder: str, shape_name: str, layers: Optional[int], seed: int = 0) -> str:
    """A random bf16 checkpoint of the shape in `folder` (written once: an existing complete one is reused)."""
    shape = dict(SHAPES[shape_name])
    if layers:
        shape["num_hidden_layers"] = layers
    done = os.path.join(folder, ".complete")
    if os.path.isfile(done):
        return folder
    from transformers import AutoConfig, GenerationConfig

    from export.random_checkpoint import build_tokenizer

    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    cfg = AutoConfig.for_model("qwen2", max_position_embeddings=32768, rms_norm_eps=1e-6, bos_token_id=eos,
                               eos_token_id=eos, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                               use_sliding_window=False, dtype="bfloat16", **shape)
    cfg.save_pretrained(folder)
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    shards: List[List[tuple]] = [[]]
    size = 0
    for name, dims, init in tensors(shape):
        nbytes = int(np.prod(dims)) * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims, init))
        size += nbytes
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    start = time.perf_counter()
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dims, _ in shard:
            nbytes = int(np.prod(dims)) * 2
            header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(os.path.join(folder, fname), "wb") as fh:
            fh.write(len(text).to_bytes(8, "little") + text)
            for name, dims, (mean, std) in shard:
                for chunk in _bf16_chunks(dims, mean, std, rng):
                    fh.write(chunk.tobytes())
                weight_map[name] = fname
        total += offset
        say(f"checkpoint shard {k}/{len(shards)} written ({total / 2**30:.1f} GiB, "
            f"{time.perf_counter() - start:.0f} s)")
    with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)
    open(done, "w").close()
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


def measure(cmd: List[str], disk_path: str, env=None, stage_pattern: Optional[str] = None) -> Dict[str, Any]:
    """Run `cmd`, sampling its tree's anonymous memory and the used bytes of `disk_path`'s file system.

    stage_pattern: a regex whose group 1 names a stage in a line of the command's stderr; samples are then
    also attributed to the stage last named."""
    base = _used_bytes(disk_path)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stages: List[List[Any]] = [["start", 0.0, 0, 0]]  # name, start s, peak anon, peak disk
    peak = {"anon": 0, "disk": 0}
    err_lines: List[str] = []

    def read_err() -> None:
        for line in proc.stderr:
            err_lines.append(line)
            found = re.search(stage_pattern, line) if stage_pattern else None
            if found:
                stages.append([found.group(1), time.perf_counter() - start, 0, 0])

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    while proc.poll() is None:
        anon, disk = _anon_bytes(_tree(proc.pid)), _used_bytes(disk_path) - base
        peak["anon"], peak["disk"] = max(peak["anon"], anon), max(peak["disk"], disk)
        stages[-1][2], stages[-1][3] = max(stages[-1][2], anon), max(stages[-1][3], disk)
        time.sleep(0.1)
    out = proc.stdout.read()
    reader.join()
    wall = time.perf_counter() - start
    result = {"cmd": " ".join(shlex.quote(c) for c in cmd), "returncode": proc.returncode,
              "seconds": round(wall, 1), "peak_anon_gib": round(peak["anon"] / 2**30, 2),
              "peak_disk_gib": round(peak["disk"] / 2**30, 2), "stdout": out.strip().splitlines()[-3:],
              "stderr_tail": [line.rstrip() for line in err_lines[-5:]]}
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
    result = measure(cmd, os.path.dirname(output), stage_pattern=r"INFO export\.pipeline: stage (\w+)")
    result["output_gib"] = round(folder_bytes(output) / 2**30, 2) if os.path.exists(output) else None
    if result["output_gib"]:
        result["peak_disk_over_output"] = round(result["peak_disk_gib"] / result["output_gib"], 3)
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


def run_llama_cpp(checkpoint: str, output: str, cold: bool) -> Dict[str, Any]:
    import llama_cpp

    try:
        src = llama_cpp.source_dir(llama_cpp.DEFAULT_WORK)
        llama_cpp.converter_dependencies()
    except llama_cpp.Skip as exc:
        return {"skipped": str(exc)}
    if os.path.exists(output):
        os.remove(output)
    if cold:
        drop_caches()
    cmd, env = llama_cpp.converter_command(src, checkpoint, "f16", output)
    say(f"running llama.cpp's convert_hf_to_gguf.py --outtype f16 on {checkpoint}")
    result = measure(cmd, os.path.dirname(output), env=env)
    result["cmd"] = f"convert_hf_to_gguf.py {checkpoint} --outtype f16 --outfile {output}"
    result["output_gib"] = round(folder_bytes(output) / 2**30, 2) if os.path.exists(output) else None
    say(f"llama.cpp: {result['seconds']} s, exit {result['returncode']}, peak anon {result['peak_anon_gib']} GiB, "
        f"peak disk {result['peak_disk_gib']} GiB, GGUF {result['output_gib']} GiB")
    return result


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
    p.add_argument("--llama_cpp", action="store_true", help="also time llama.cpp's converter (f16 GGUF)")
    p.add_argument("--drop_caches", action="store_true", help="empty the page cache before each run (root)")
    p.add_argument("--keep", action="store_true", help="keep the exported folders")
    p.add_argument("--check", action="store_true",
                   help="after each export, time python -m lite_runtime.check on the folder (backend ms) the same way")
    p.add_argument("--json", dest="json_path", help="write the results as JSON to this file")
    args = p.parse_args(argv)
    tag = args.shape + (f"-{args.layers}l" if args.layers else "")
    os.makedirs(args.work_dir, exist_ok=True)
    say(f"checkpoint {tag} in {args.work_dir}")
    checkpoint = write_checkpoint(os.path.join(args.work_dir, f"ckpt-{tag}"), args.shape, args.layers)
    doc: Dict[str, Any] = {"machine": machine(), "shape": args.shape, "layers": args.layers,
                           "checkpoint_gib": round(folder_bytes(checkpoint) / 2**30, 2), "runs": []}
    if args.llama_cpp:
        gguf = os.path.join(args.work_dir, f"{tag}-f16.gguf")
        doc["llama_cpp"] = run_llama_cpp(checkpoint, gguf, args.drop_caches)
        if os.path.exists(gguf):
            os.remove(gguf)
    for extra in args.export or [""]:
        output = os.path.join(args.work_dir, f"out-{tag}")
        result = run_ours(checkpoint, output, shlex.split(extra), args.drop_caches)
        result["args"] = extra
        if args.check and result["returncode"] == 0:
            result["check"] = run_check(output, args.drop_caches)
        doc["runs"].append(result)
        if not args.keep:
            shutil.rmtree(output, ignore_errors=True)
    print(json.dumps(doc, indent=1))
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
    return 0 if all(r["returncode"] == 0 for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
