"""Load on the OpenAI-compatible server: a batch-4 folder against a batch-1 folder of the same checkpoint, served
the same way (`python -m lite_runtime.serve`, loopback only), in one run.

    python benchmarks/bench_serve.py --checkpoint <hf_dir> --work bench_serve/ [--output FILE]

Without --checkpoint a random Qwen2-0.5B-shaped one is made (benchmarks/benchmark.py); its files are linked beside a
word-level tokenizer of the whole vocabulary (full_vocab_checkpoint), so every token is text. Each folder is exported as
`python -m export --device cpu --seq_length 512 --batch_size B` (nothing else). For each folder, against its own
server process:
- 1, 4 and 16 concurrent clients, each sending its share of the same set of greedy streaming requests
  (random-token prompts of 16-96 tokens, max_tokens 48): aggregate completion tok/s, time to first token and
  latency at p50 and p99;
- with --itl: 3 running streams while a prompt of seq_length - 64 tokens arrives: their steady inter-token gap
  against the gaps while it is prefilled (p99 and largest; issue 21: at most 2x), and its time to first token;
- with --turns: the second turn of a conversation (its first turn's prompt of seq_length / 2 words, the answer, 32
  new words): its time to first token with prefix reuse and, on a second server, with --prefix_reuse off;
- every request's text is compared with the text the 1-client load got for the same prompt (no request lost,
  no cross-talk between rows);
- 500 sequential short requests: the server's RSS after the first 20 and after all 500 (growth), and its peak.
Prints a table and the goals' ratios; writes JSON. Benchmarks are not tests: nothing here runs in the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # benchmark.py


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class Server:
    """`python -m lite_runtime.serve` on `folder` from the checkout `root` (ms backend, `extra` arguments), its log in
    `log_path`; ready once /health answers (SystemExit if it exits first, or takes more than `timeout` seconds)."""

    def __init__(self, folder: str, log_path: str, root: str = ROOT, extra: Sequence[str] = (),
                 timeout: Optional[float] = None) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        start = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "lite_runtime.serve", "--model_dir", folder, "--port",
                                      str(self.port), "--backend", "ms", "--log_level", "warning", *extra], cwd=root,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"the server for {folder} exited; see {log_path}")
            if timeout is not None and time.perf_counter() - start > timeout:
                raise SystemExit(f"the server for {folder} did not come up in {timeout:g} s; see {log_path}")
            time.sleep(0.2)
        self.ready_s = time.perf_counter() - start

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def one_request(url: str, prompt: List[int], max_tokens: int) -> Dict[str, Any]:
    """A streaming greedy completion: text, tokens, time to first text and latency (seconds)."""
    import httpx

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, parts, usage, finish = None, [], None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code} {r.read().decode()[:200]}"}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if first is None:
                    first = time.perf_counter() - start
                parts.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
    return {"text": "".join(parts), "tokens": usage["completion_tokens"] if usage else 0, "ttft": first,
            "latency": time.perf_counter() - start, "finish": finish}


def stream_times(url: str, prompt: List[int], max_tokens: int, out: Dict[str, Any]) -> None:
    """A greedy streaming completion; out["times"]: the arrival time (perf_counter) of every text chunk."""
    import httpx

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    out["start"], out["times"] = time.perf_counter(), []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                out["times"].append(time.perf_counter())


def itl_while_a_long_prompt_arrives(url: str, seq_length: int, rng) -> Dict[str, Any]:
    """Issue 21's measure: 3 running streams, then a prompt of seq_length - 64 tokens. The streams' inter-token
    gaps: their median before it arrives (steady), and the largest while it is prefilled (from its submission to its
    first token, plus one step); the long prompt's time to first token."""
    import statistics

    streams = [dict() for _ in range(3)]
    threads = [threading.Thread(target=stream_times, args=(url, [int(t) for t in rng.integers(100, 20000, 24)],
                                                          100, out)) for out in streams]
    for t in threads:
        t.start()
    while min(len(s.get("times", [])) for s in streams) < 24:  # steady: every stream decoding
        time.sleep(0.01)
    long = {}
    submitted = time.perf_counter()
    stream_times(url, [int(t) for t in rng.integers(100, 20000, seq_length - 64)], 4, long)
    first = long["times"][0]
    for t in threads:
        t.join()
    steady, during = [], []
    for s in streams:
        for a, b in zip(s["times"], s["times"][1:]):
            if b < submitted:
                steady.append(b - a)
            elif a < first + (statistics.median(steady) if steady else 0):
                during.append(b - a)
    p50 = statistics.median(steady)
    return {"long_prompt_tokens": seq_length - 64, "steady_itl_p50_s": p50, "steady_gaps_s": steady,
            "gaps_during_prefill_s": during, "itl_max_during_prefill_s": max(during),
            "itl_p99_during_prefill_s": percentile(during, 99), "gaps_during_prefill": len(during),
            "ratio": max(during) / p50, "ratio_p99": percentile(during, 99) / p50, "long_prompt_ttft_s": first - submitted}


def second_turn(url: str, seq_length: int, rng) -> Dict[str, Any]:
    """A conversation's second turn: turn 1 is a prompt of seq_length / 2 words (the word-level tokenizer: a word a
    token) answered with 16 tokens; turn 2 is turn 1, its answer and 32 new words. Its time to first token and the
    prompt tokens the server reports cached."""
    import httpx

    first = " ".join(f"t{int(t)}" for t in rng.integers(100, 20000, seq_length // 2))
    body = {"prompt": first, "max_tokens": 16, "temperature": 0}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=600).json()["choices"][0]["text"]
    prompt = first + answer + " " + " ".join(f"t{int(t)}" for t in rng.integers(100, 20000, 32))
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, usage = time.perf_counter(), None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and ttft is None:
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    return {"prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "ttft_s": ttft}


def bench_turns(folder: str, args) -> Dict[str, Any]:
    """second_turn on a server with prefix reuse and on one without (--prefix_reuse off), 3 conversations each."""
    import numpy as np
    import statistics

    out: Dict[str, Any] = {}
    for label, extra in (("reuse", ()), ("no_reuse", ("--prefix_reuse", "off"))):
        server = Server(folder, os.path.join(args.work, f"{os.path.basename(folder)}.turns-{label}.server.log"),
                        extra=extra)
        try:
            second_turn(server.url, args.seq_length, np.random.default_rng(99))  # compiles what it needs
            out[label] = [second_turn(server.url, args.seq_length, np.random.default_rng(i)) for i in range(3)]
        finally:
            server.stop()
    a, b = (statistics.median(r["ttft_s"] for r in out[k]) for k in ("reuse", "no_reuse"))
    out["ttft_ratio"] = a / b
    t = out["reuse"][0]
    print(f"  {os.path.basename(folder)}: second turn ({t['prompt_tokens']} prompt tokens, {t['cached_tokens']} "
          f"cached) time to first token {a:.3f} s with prefix reuse, {b:.3f} s without ({a / b:.2f}x)", flush=True)
    return out


def run_load(url: str, prompts: List[List[int]], clients: int, max_tokens: int) -> Dict[str, Any]:
    results: List[Optional[Dict[str, Any]]] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            results[i] = one_request(url, prompts[i], max_tokens)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [r for r in results if r and "error" not in r and r.get("finish")]
    tokens = sum(r["tokens"] for r in ok)
    return {"clients": clients, "requests": len(prompts), "completed": len(ok), "wall_s": wall,
            "tok_s": tokens / wall, "tokens": tokens,
            "ttft_p50": percentile([r["ttft"] for r in ok], 50), "ttft_p99": percentile([r["ttft"] for r in ok], 99),
            "latency_p50": percentile([r["latency"] for r in ok], 50),
            "latency_p99": percentile([r["latency"] for r in ok], 99),
            "texts": [r.get("text") if r else None for r in results],
            "errors": [r["error"] for r in results if r and "error" in r]}


def full_vocab_checkpoint(checkpoint: str, work: str) -> str:
    """The checkpoint (its files linked) with a word-level tokenizer of its whole vocabulary: id i is the text
    `t<i>` (0 is <|endoftext|>, the eos). A random 0.5B-shaped checkpoint's demo tokenizer covers a few hundred
    ids, and the rest decode to nothing: no text to time the first token by, none to compare between loads."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    out = os.path.join(work, "checkpoint-word-level")
    if os.path.isfile(os.path.join(out, "tokenizer.json")):
        return out
    os.makedirs(out, exist_ok=True)
    skip = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "vocab.json", "merges.txt",
            "special_tokens_map.json", "tokenizer.model", "generation_config.json"}
    for name in os.listdir(checkpoint):
        if name not in skip:
            os.symlink(os.path.abspath(os.path.join(checkpoint, name)), os.path.join(out, name))
    with open(os.path.join(checkpoint, "config.json")) as fh:
        vocab_size = json.load(fh)["vocab_size"]
    eos = "<|endoftext|>"
    tokenizer = Tokenizer(models.WordLevel({eos: 0, **{f"t{i}": i for i in range(1, vocab_size)}}, unk_token=eos))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(eos, special=True)])
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as fh:
        json.dump({"eos_token": eos, "pad_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}, fh)
    with open(os.path.join(out, "generation_config.json"), "w") as fh:
        json.dump({"eos_token_id": 0, "pad_token_id": 0, "do_sample": False}, fh)
    return out


def export(checkpoint: str, folder: str, batch: int, seq_length: int, dtype: Optional[str] = None) -> None:
    if os.path.isfile(os.path.join(folder, "manifest.json")):
        print(f"using {folder}", flush=True)
        return
    cmd = [sys.executable, "-m", "export", "--checkpoint", checkpoint, "--output", folder, "--device", "cpu",
           "--seq_length", str(seq_length), "--batch_size", str(batch)] + (["--dtype", dtype] if dtype else [])
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def bench_folder(folder: str, args, prompts: List[List[int]], short: List[List[int]], root: str = ROOT,
                 label: str = "") -> Dict[str, Any]:
    import statistics

    import numpy as np

    server = Server(folder, os.path.join(args.work, os.path.basename(folder) + label + ".server.log"), root)
    try:
        out: Dict[str, Any] = {"ready_s": server.ready_s, "loads": []}
        one_request(server.url, prompts[0], 4)  # compiles what the first request needs beyond the warm-up
        for clients in args.clients:
            load = run_load(server.url, prompts, clients, args.max_tokens)
            print(f"  {os.path.basename(folder)}{label}: {clients:>2} clients  {load['tok_s']:6.1f} tok/s  ttft p50 "
                  f"{load['ttft_p50']:.2f} s p99 {load['ttft_p99']:.2f} s  latency p50 {load['latency_p50']:.2f} s "
                  f"p99 {load['latency_p99']:.2f} s  {load['completed']}/{load['requests']} completed", flush=True)
            out["loads"].append(load)
        if args.itl:
            for repeat in range(3):
                itl = itl_while_a_long_prompt_arrives(server.url, args.seq_length, np.random.default_rng(repeat))
                out.setdefault("itl_long_prompt", []).append(itl)
                print(f"  {os.path.basename(folder)}{label}: 3 streams while a {itl['long_prompt_tokens']}-token "
                      f"prompt arrives: steady ITL p50 {itl['steady_itl_p50_s'] * 1000:.0f} ms, largest gap "
                      f"{itl['itl_max_during_prefill_s'] * 1000:.0f} ms ({itl['ratio']:.1f}x), p99 "
                      f"{itl['itl_p99_during_prefill_s'] * 1000:.0f} ms ({itl['ratio_p99']:.1f}x; goal <= 2x) over "
                      f"{itl['gaps_during_prefill']} gaps, long prompt TTFT {itl['long_prompt_ttft_s']:.2f} s",
                      flush=True)
        if args.itl:  # the three repeats' gaps together: p99 over some 100-300 gaps, not the largest of one repeat
            runs = out["itl_long_prompt"]
            steady = statistics.median([g for r in runs for g in r["steady_gaps_s"]])
            pooled = percentile([g for r in runs for g in r["gaps_during_prefill_s"]], 99)
            out["itl_pooled"] = {"steady_p50_s": steady, "p99_during_prefill_s": pooled, "ratio_p99": pooled / steady,
                                 "p50_during_prefill_s": percentile([g for r in runs for g in r["gaps_during_prefill_s"]], 50)}
            print(f"  {os.path.basename(folder)}{label}: the 3 repeats together: steady p50 {steady * 1000:.0f} ms, "
                  f"gaps while prefilling p50 {out['itl_pooled']['p50_during_prefill_s'] * 1000:.0f} ms, p99 "
                  f"{pooled * 1000:.0f} ms ({pooled / steady:.2f}x; goal <= 2x)", flush=True)
        # sequential: RSS growth after the first 20 requests
        rss = []
        seq_start = time.perf_counter()
        lost = 0
        for i, prompt in enumerate(short):
            r = one_request(server.url, prompt, args.short_max_tokens)
            lost += int("error" in r or not r.get("finish"))
            if i == 19:
                rss.append(rss_kib(server.proc.pid))
        rss.append(rss_kib(server.proc.pid))
        out["sequential"] = {"requests": len(short), "lost": lost, "wall_s": time.perf_counter() - seq_start,
                             "rss_after_20_mib": rss[0] / 1024, "rss_after_all_mib": rss[1] / 1024,
                             "rss_growth_pct": 100.0 * (rss[1] - rss[0]) / rss[0]}
        out["peak_rss_gib"] = rss_kib(server.proc.pid, "VmHWM") / 2 ** 20
        print(f"  {os.path.basename(folder)}: {len(short)} sequential, lost {lost}, RSS "
              f"{rss[0] / 1024:.0f} -> {rss[1] / 1024:.0f} MiB ({out['sequential']['rss_growth_pct']:+.2f} %), "
              f"peak {out['peak_rss_gib']:.2f} GiB", flush=True)
        return out
    finally:
        server.stop()


def main(argv: Optional[List[str]] = None) -> int:
    import numpy as np

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="HF checkpoint (default: a random Qwen2-0.5B-shaped one in --work)")
    p.add_argument("--work", required=True, help="folder for the checkpoint, the model folders and server logs")
    p.add_argument("--batch_sizes", default="4,1")
    p.add_argument("--seq_length", type=int, default=512)
    p.add_argument("--dtype", default=None, help="python -m export --dtype (default: the export's own default)")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests", type=int, default=32, help="requests per load (default 32)")
    p.add_argument("--max_tokens", type=int, default=48)
    p.add_argument("--sequential", type=int, default=500)
    p.add_argument("--short_max_tokens", type=int, default=4)
    p.add_argument("--output", help="write the figures as JSON here (default: benchmarks/results/bench-serve.json, "
                                     "-ab with --baseline_root, -chunks with --turns, -itl with --itl alone, then "
                                     "-f32 / -bf16 / -f16 with --dtype)")
    p.add_argument("--baseline_root", help="A/B: also serve each folder with the checkout in this directory (e.g. a "
                                           "git worktree of the previous commit), alternating with this one")
    p.add_argument("--itl", action="store_true",
                   help="also: 3 running streams while a prompt of seq_length - 64 tokens arrives (issue 21's "
                        "measure of the prefill pause), 3 times per folder")
    p.add_argument("--turns", action="store_true",
                   help="also: a conversation's second turn, its time to first token with and without prefix reuse "
                        "(two more servers per folder)")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --baseline_root: rounds of both, the order alternating (baseline first in the first)")
    args = p.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",")]
    os.makedirs(args.work, exist_ok=True)
    checkpoint = args.checkpoint
    if not checkpoint:
        import benchmark

        checkpoint = benchmark.ensure_checkpoint(argparse.Namespace(checkpoint=None, work=args.work))
    checkpoint = full_vocab_checkpoint(checkpoint, args.work)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, 20000, int(n))] for n in rng.integers(16, 97, args.requests)]
    short = [[int(t) for t in rng.integers(100, 20000, 16)] for _ in range(args.sequential)]
    report: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, "
                              f"{os.cpu_count()} cores", "checkpoint": checkpoint, "seq_length": args.seq_length,
                              "max_tokens": args.max_tokens, "folders": {}}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        folder = os.path.join(args.work, f"serve_b{batch}_s{args.seq_length}" + (f"_{args.dtype}" if args.dtype else ""))
        export(checkpoint, folder, batch, args.seq_length, args.dtype)
        if args.baseline_root:
            report["ab"] = report.get("ab", {})
            runs = report["ab"][batch] = {"baseline": [], "this": []}
            pair = [("baseline", os.path.abspath(args.baseline_root)), ("this", ROOT)]
            for round_ in range(args.rounds):  # the order alternates: neither checkout always runs first
                for label, root in (pair if round_ % 2 == 0 else pair[::-1]):
                    runs[label].append(bench_folder(folder, args, prompts, short, root, label=f" ({label})"))
            report["folders"][batch] = runs["this"][-1]
            print_ab(batch, runs)
        else:
            report["folders"][batch] = bench_folder(folder, args, prompts, short)
        if args.turns:
            report["folders"][batch]["second_turn"] = bench_turns(folder, args)
    # cross-talk: every load's texts equal the batch-1 folder's 1-client texts (the solo reference)
    base = min(report["folders"])
    reference = report["folders"][base]["loads"][0]["texts"]
    for batch, result in report["folders"].items():
        for load in result["loads"]:
            load["same_texts_as_solo"] = sum(t == r for t, r in zip(load["texts"], reference))
    print_table(report, args)
    for result in report["folders"].values():
        for load in result["loads"]:
            load.pop("texts")
    path = args.output or default_output(args)
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"wrote {path}")
    return 0


DTYPE_SUFFIX = {"float32": "-f32", "bfloat16": "-bf16", "float16": "-f16"}


def default_output(args) -> str:
    """benchmarks/results/bench-serve[-ab|-chunks|-itl][-<dtype>].json: one file per kind of run, the latest."""
    mode = "-ab" if args.baseline_root else "-chunks" if args.turns else "-itl" if args.itl else ""
    return os.path.join(RESULTS, f"bench-serve{mode}{DTYPE_SUFFIX.get(args.dtype, '')}.json")


def print_ab(batch: int, runs: Dict[str, List[Dict[str, Any]]]) -> None:
    """Median tok/s per load of each checkout, the ratio, and the spread between rounds of the same checkout."""
    import statistics

    print(f"\nA/B, batch-{batch} folder: tok/s this / baseline (median of {len(runs['this'])} rounds each)")
    for i, load in enumerate(runs["this"][0]["loads"]):
        a = [r["loads"][i]["tok_s"] for r in runs["baseline"]]
        b = [r["loads"][i]["tok_s"] for r in runs["this"]]
        spread = max((max(x) - min(x)) / statistics.median(x) for x in (a, b)) if len(a) > 1 else float("nan")
        print(f"  {load['clients']:>2} clients: baseline {statistics.median(a):.1f}, this {statistics.median(b):.1f}, "
              f"ratio {statistics.median(b) / statistics.median(a):.3f} (spread between rounds {100 * spread:.1f} %)")


def print_table(report: Dict[str, Any], args) -> None:
    print(f"\n{report['date']}, {report['machine']}; seq_length {report['seq_length']}, greedy, max_tokens "
          f"{report['max_tokens']}, {args.requests} requests per load\n")
    print("| folder | clients | tok/s | TTFT p50 / p99 (s) | latency p50 / p99 (s) | completed | same text as solo |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for batch, result in report["folders"].items():
        for load in result["loads"]:
            print(f"| batch {batch} | {load['clients']} | {load['tok_s']:.1f} | {load['ttft_p50']:.2f} / "
                  f"{load['ttft_p99']:.2f} | {load['latency_p50']:.2f} / {load['latency_p99']:.2f} | "
                  f"{load['completed']}/{load['requests']} | {load['same_texts_as_solo']}/{load['requests']} |")
    print("\n| folder | sequential requests | lost | RSS after 20 -> after all (MiB) | growth | peak RSS (GiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for batch, result in report["folders"].items():
        s = result["sequential"]
        print(f"| batch {batch} | {s['requests']} | {s['lost']} | {s['rss_after_20_mib']:.0f} -> "
              f"{s['rss_after_all_mib']:.0f} | {s['rss_growth_pct']:+.2f} % | {result['peak_rss_gib']:.2f} |")
    if 4 in report["folders"]:
        loads = {load["clients"]: load for load in report["folders"][4]["loads"]}
        if 1 in loads and 4 in loads:
            print(f"\nbatch-4 folder, 4 clients / 1 client aggregate tok/s: {loads[4]['tok_s'] / loads[1]['tok_s']:.2f}x "
                  "(goal >= 3x)")
        if 1 in report["folders"]:
            one = {load["clients"]: load for load in report["folders"][1]["loads"]}
            if 4 in one and 4 in loads:
                print(f"4 clients: batch-4 folder / batch-1 folder tok/s: {loads[4]['tok_s'] / one[4]['tok_s']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
