"""The paged KV cache against the peers (issue 44): our server, the row design it replaced, llama.cpp's llama-server
and vLLM's CPU build, the same model, dtype and KV memory, every server loaded by vLLM's own load generator
(`vllm bench serve`), in one run on one machine.

    python benchmarks/bench_paged_serve.py --checkpoint demo/smollm2 [--work /tmp/bench-paged]
        [--engines ours,rows,llama,vllm] [--workloads users,prefix] [--kv_gib 1] [--output FILE]

Engines (each its own process, started, loaded, stopped in turn; 2 threads each):
- ours: `python -m export --device cpu --dtype bfloat16 --batch_size 16 --seq_length 8192 --prefill_buckets 16` (the
  server runs the chunk and inc graphs only; the buckets would cost the export golden references of ten), served
  with `--kv_cache_memory <kv_gib>`: 16 graph rows over a pool of that memory;
- rows: the row design before the paged cache (git commit ROW_DESIGN, a worktree of this repository), the same
  export at `--batch_size R` with R x 8192 tokens the same memory (R = 6 at 1 GiB): concurrency capped at R;
- llama: llama-server built from the vendored llama.cpp (benchmarks/llama_cpp.py), the checkpoint converted to a bf16
  GGUF, `-c <tokens> -np 16 --kv-unified`, tokens = the same memory;
- vllm: vLLM CPU 0.32 (../shared/peers/install_vllm_cpu.sh), `--dtype bfloat16 --max-model-len 8192`,
  VLLM_CPU_KVCACHE_SPACE=<kv_gib>.
Workloads (`vllm bench serve --backend openai`, random prompts with --ignore-eos):
- users: 16 users at once, max context 8192: prompts of 256 tokens, 64 new tokens, 32 requests;
- prefix: two 1024-token prefixes, 16 requests, 8 at once (vLLM's prefix_repetition dataset, 64-token suffixes, 32
  new tokens), on our server with prefix caching and again with --prefix_reuse off: the hit rate from /metrics and
  the mean time to first token of each.
Prints the table with each server's command line; writes JSON (machine, date, which CPU path ran). Not a test.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

ROW_DESIGN = "a8abe5e"  # the last commit with the KV cache as rows in the weights file
SEQ_LENGTH = 8192
VLLM = os.path.expanduser("~/.cache/vllm-cpu/bin/vllm")
GIB = 1 << 30


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Proc:
    """A server process; ready once `health` answers 200."""

    def __init__(self, cmd: Sequence[str], log: str, health: str, env=None, cwd=ROOT, timeout: float = 1800) -> None:
        import httpx

        self.cmd, self.url = list(cmd), health.rsplit("/health", 1)[0]
        self.log = open(log, "w")
        start = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        while True:
            try:
                if httpx.get(health, timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"{cmd[0]} exited; see {log}")
            if time.perf_counter() - start > timeout:
                self.stop()
                raise SystemExit(f"{cmd[0]} did not come up in {timeout:g} s; see {log}")
            time.sleep(0.5)
        self.ready_s = round(time.perf_counter() - start, 1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def kv_bytes_per_token(checkpoint: str, itemsize: int = 2) -> int:
    with open(os.path.join(checkpoint, "config.json")) as fh:
        c = json.load(fh)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * itemsize


def export(root: str, checkpoint: str, out: str, batch: int) -> str:
    if not os.path.isfile(os.path.join(out, "manifest.json")):
        say(f"exporting {checkpoint} (bfloat16, batch {batch}, seq_length {SEQ_LENGTH}) with {root}")
        subprocess.run([sys.executable, "-m", "export", "--checkpoint", os.path.abspath(checkpoint), "--output", out,
                        "--device", "cpu", "--dtype", "bfloat16", "--seq_length", str(SEQ_LENGTH), "--batch_size",
                        str(batch), "--prefill_buckets", "16", "--overwrite", "-q"], cwd=root, check=True)
    return out


def row_design_tree(work: str) -> str:
    """A worktree of this repository at ROW_DESIGN with its kernels built (once)."""
    tree = os.path.join(work, f"rows-{ROW_DESIGN}")
    if not os.path.isdir(tree):
        say(f"checking out {ROW_DESIGN} (the row design) into {tree}")
        subprocess.run(["git", "worktree", "add", "--detach", tree, ROW_DESIGN], cwd=ROOT, check=True,
                       capture_output=True)
    if not any(f.startswith("mslite_llm_cpu_kernels") for f in os.listdir(os.path.join(tree, "cpu_kernels"))):
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=tree, check=True,
                       capture_output=True)
    return tree


def bench_serve(url: str, model: str, tokenizer: str, workload: str, result: str) -> Dict[str, Any]:
    """`vllm bench serve` against `url`; its saved result."""
    args = [VLLM, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", os.path.abspath(tokenizer), "--ignore-eos", "--seed", "0",
            "--save-result", "--result-dir", os.path.dirname(result), "--result-filename", os.path.basename(result)]
    if workload == "users":
        args += ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64",
                 "--num-prompts", "32", "--max-concurrency", "16"]
    else:
        args += ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
                 "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "2",
                 "--prefix-repetition-output-len", "32", "--num-prompts", "16", "--max-concurrency", "8"]
    say(f"vllm bench serve {workload} -> {url}")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=7200)
    if proc.returncode != 0:
        raise SystemExit(f"vllm bench serve failed: {proc.stderr[-3000:]}")
    with open(result) as fh:
        out = json.load(fh)
    keep = ("completed", "duration", "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms", "median_itl_ms")
    return {k: out.get(k) for k in keep} | {"command": " ".join(args[1:])}


def metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return 0.0


def run_ours(root: str, folder: str, args, tag: str, extra: Sequence[str] = ()) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "lite_runtime.serve", "--model_dir", folder, "--port", str(port), "--backend", "ms",
           "--log_level", "warning", *extra]
    return Proc(cmd, os.path.join(args.work, f"{tag}.log"), f"http://127.0.0.1:{port}/health", cwd=root)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=os.path.join(ROOT, "demo", "smollm2"))
    p.add_argument("--work", default="/tmp/bench-paged")
    p.add_argument("--engines", default="ours,rows,llama,vllm")
    p.add_argument("--workloads", default="users,prefix")
    p.add_argument("--kv_gib", type=float, default=1.0)
    p.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results", "bench-paged-serve.json"))
    args = p.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    engines, workloads = args.engines.split(","), args.workloads.split(",")
    per_token = kv_bytes_per_token(args.checkpoint)
    kv_tokens = int(args.kv_gib * GIB // per_token)
    rows = max(1, kv_tokens // SEQ_LENGTH)
    import cpu_kernels

    report: Dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "kernels_isa": cpu_kernels.isa()},
        "model": os.path.basename(os.path.abspath(args.checkpoint)), "dtype": "bfloat16",
        "kv_memory_gib": args.kv_gib, "kv_tokens": kv_tokens, "max_context": SEQ_LENGTH, "engines": {}}
    if os.path.isfile(args.output):  # engines measured by an earlier run (another --engines) are kept beside these
        with open(args.output) as fh:
            earlier = json.load(fh)
        if earlier.get("kv_memory_gib") == args.kv_gib and earlier.get("model") == report["model"]:
            report["engines"] = {k: dict(v, date=v.get("date", earlier.get("date")))
                                 for k, v in earlier.get("engines", {}).items() if k not in engines}
    name = report["model"]
    for engine in engines:
        results: Dict[str, Any] = {}
        if engine == "ours":
            folder = export(ROOT, args.checkpoint, os.path.join(args.work, "ours-b16"), 16)
            server = run_ours(ROOT, folder, args, "ours", ["--kv_cache_memory", str(args.kv_gib)])
            url = server.url
            try:
                for w in workloads:
                    q0, h0 = metric(url, "mslite_llm:prefix_cache_queries_total"), metric(
                        url, "mslite_llm:prefix_cache_hits_total")
                    results[w] = bench_serve(url, "ours-b16", args.checkpoint, w,
                                             os.path.join(args.work, f"ours-{w}.json"))
                    results[w]["prefix_hits"] = metric(url, "mslite_llm:prefix_cache_hits_total") - h0
                    results[w]["prefix_queries"] = metric(url, "mslite_llm:prefix_cache_queries_total") - q0
                    results[w]["preemptions"] = metric(url, "mslite_llm:num_preemptions_total")
                results["server"] = " ".join(server.cmd[1:])
            finally:
                server.stop()
            if "prefix" in workloads:  # the same run without prefix caching
                server = run_ours(ROOT, folder, args, "ours-nocache", ["--kv_cache_memory", str(args.kv_gib),
                                                                      "--prefix_reuse", "off"])
                url = server.url
                try:
                    results["prefix_off"] = bench_serve(url, "ours-b16", args.checkpoint, "prefix",
                                                        os.path.join(args.work, "ours-prefix-off.json"))
                finally:
                    server.stop()
        elif engine == "rows":
            tree = row_design_tree(args.work)
            folder = export(tree, args.checkpoint, os.path.join(args.work, f"rows-b{rows}"), rows)
            server = run_ours(tree, folder, args, "rows")
            url = server.url
            try:
                for w in workloads:
                    results[w] = bench_serve(url, f"rows-b{rows}", args.checkpoint, w,
                                             os.path.join(args.work, f"rows-{w}.json"))
                results["server"] = f"(commit {ROW_DESIGN}) " + " ".join(server.cmd[1:])
            finally:
                server.stop()
        elif engine == "llama":
            import llama_cpp

            src = llama_cpp.source_dir("/tmp/ppl")
            binary = llama_cpp.build_tool(src, "llama-server")
            gguf = llama_cpp.convert(src, args.checkpoint, "bf16", args.work)["gguf"]
            port = free_port()
            cmd = [binary, "-m", gguf, "-c", str(kv_tokens), "-np", "16", "--kv-unified", "-t", "2", "--port",
                   str(port), "--host", "127.0.0.1", "-a", name]
            server = Proc(cmd, os.path.join(args.work, "llama.log"), f"http://127.0.0.1:{port}/health")
            try:
                for w in workloads:
                    results[w] = bench_serve(f"http://127.0.0.1:{port}", name, args.checkpoint, w,
                                             os.path.join(args.work, f"llama-{w}.json"))
                results["server"] = " ".join(cmd)
            finally:
                server.stop()
        elif engine == "vllm":
            port = free_port()
            cmd = [VLLM, "serve", os.path.abspath(args.checkpoint), "--dtype", "bfloat16", "--max-model-len",
                   str(SEQ_LENGTH), "--port", str(port), "--host", "127.0.0.1", "--served-model-name", name]
            if args.kv_gib != int(args.kv_gib):
                raise SystemExit(f"vLLM takes VLLM_CPU_KVCACHE_SPACE in whole GiB; --kv_gib {args.kv_gib:g} is not")
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(int(args.kv_gib)), VLLM_CPU_OMP_THREADS_BIND="0-1",
                       OMP_NUM_THREADS="2")
            server = Proc(cmd, os.path.join(args.work, "vllm.log"), f"http://127.0.0.1:{port}/health", env=env)
            try:
                for w in workloads:
                    results[w] = bench_serve(f"http://127.0.0.1:{port}", name, args.checkpoint, w,
                                             os.path.join(args.work, f"vllm-{w}.json"))
                results["server"] = "VLLM_CPU_KVCACHE_SPACE=%g " % args.kv_gib + " ".join(cmd)
            finally:
                server.stop()
        results["date"] = report["date"]
        report["engines"][engine] = results
        with open(args.output, "w") as fh:
            json.dump(report, fh, indent=1)
    print_table(report)
    return 0


def print_table(report: Dict[str, Any]) -> None:
    print(f"{report['model']} {report['dtype']}, KV memory {report['kv_memory_gib']} GiB ({report['kv_tokens']} "
          f"tokens), max context {report['max_context']}; {report['machine']}; {report['date']}")
    print("| server | workload | output tok/s | mean TTFT ms | median TPOT ms |")
    print("| --- | --- | --- | --- | --- |")
    for engine, results in report["engines"].items():
        for w, r in results.items():
            if isinstance(r, dict):
                print(f"| {engine} | {w} | {r['output_throughput']:.1f} | {r['mean_ttft_ms']:.0f} | "
                      f"{r['median_tpot_ms']:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
