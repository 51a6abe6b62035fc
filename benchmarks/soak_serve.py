"""A soak of the OpenAI-compatible server that proves nothing is lost: N clients for M minutes against one server.

    python benchmarks/soak_serve.py --model_dir model_dirs/<batch-4 folder> [--clients 8] [--minutes 10]
                                 [--output benchmarks/results/soak.json]

The server is started here (`python -m lite_runtime.serve --backend ms --max_queue 2 --max_body_bytes 65536`).
A fixed set of request specs (seeded) mixes completions and chat, streaming and not, greedy and seeded sampling,
stop strings, and n = 2. Each spec is first run alone: its solo answer. Then the clients send specs at random
until the time is up, and besides them: clients that disconnect after the first event, bursts past the queue
bound, and malformed bodies (bad JSON, a wrong type, NaN, a lone surrogate, a body past the limit). Checked:
- every completed answer equals its solo answer (text and finish reason of every choice);
- every refusal has its documented status: 503 with Retry-After when the queue is full, 400 / 413 for the bad
  bodies; nothing else, and never a 500;
- no row leaks: /health is back to 0 rows busy and 0 waiting after the load;
- the server's RSS after warm-up and at the end: flat within --rss_tolerance (default 2 %);
- a SIGTERM while streams are open: each ends with its finish reason (and its solo text), or a server_shutdown
  error event (past --drain_timeout), or, if it arrived after the signal, a 503 server_draining; exit status 0.
Prints a summary and a verdict; exit status 0 when every check holds. tests/test_serve_robust.py runs it short.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_serve import Server, rss_kib  # noqa: E402  (beside this file; benchmarks/ is not a package)

MALFORMED = [  # (body bytes, expected status)
    (b'{"prompt": "a",', 400),
    (b'{"prompt": "a", "max_tokens": "8"}', 400),
    (b'{"prompt": "a", "temperature": NaN}', 400),
    (b'{"prompt": "\\ud800x"}', 400),
    (b'{"messages": []}', 400),
    (b'{"prompt": "' + b"x" * 70000 + b'"}', 413),
]


def make_specs(rng: random.Random, count: int) -> List[Dict[str, Any]]:
    words = "the quick brown fox jumps over a lazy dog while models predict the next token".split()
    specs = []
    for i in range(count):
        chat = i % 2 == 1
        body: Dict[str, Any] = {"max_tokens": rng.randint(4, 24)}
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text if rng.random() < 0.5 else [rng.randint(3, 300) for _ in range(rng.randint(2, 12))]
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=rng.choice([0.7, 1.0, 1.3]), seed=rng.randint(0, 10 ** 6), top_p=0.9)
        if rng.random() < 0.3:
            body["stop"] = [rng.choice(words)]
        if rng.random() < 0.15:
            body["n"] = 2
        specs.append({"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body,
                      "stream": rng.random() < 0.5})
    return specs


def call(url: str, spec: Dict[str, Any], stream: Optional[bool] = None, disconnect: bool = False,
         timeout: float = 120) -> Dict[str, Any]:
    """{"status", "choices": {index: [text, finish]}, "error"}; a stream's error event is its "error"."""
    import httpx

    stream = spec["stream"] if stream is None else stream
    body = dict(spec["body"], stream=stream)
    chat = spec["path"].endswith("chat/completions")
    choices: Dict[int, List[Any]] = {}
    if not stream:
        r = httpx.post(url + spec["path"], json=body, timeout=timeout)
        out: Dict[str, Any] = {"status": r.status_code, "retry_after": r.headers.get("retry-after")}
        if r.status_code == 200:
            for c in r.json()["choices"]:
                choices[c["index"]] = [c["message"]["content"] if chat else c["text"], c["finish_reason"]]
        else:
            out["error"] = r.json().get("error")
        return dict(out, choices=choices)
    with httpx.stream("POST", url + spec["path"], json=body, timeout=timeout) as r:
        out = {"status": r.status_code, "retry_after": r.headers.get("retry-after")}
        if r.status_code != 200:
            r.read()
            return dict(out, error=r.json().get("error"), choices=choices)
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return dict(out, error=chunk["error"], choices=choices)
            for c in chunk["choices"]:
                entry = choices.setdefault(c["index"], ["", None])
                entry[0] += (c["delta"].get("content") or "") if chat else c["text"]
                entry[1] = c["finish_reason"] or entry[1]
            if disconnect:
                return dict(out, disconnected=True, choices=choices)
    return dict(out, choices=choices)


def soak(folder: str, clients: int, seconds: float, seed: int, work: str, specs_count: int = 24,
         rss_tolerance: float = 2.0) -> Dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    specs = make_specs(rng, specs_count)
    os.makedirs(work, exist_ok=True)
    server = Server(folder, os.path.join(work, "soak.server.log"), extra=(
        "--max_queue", "2", "--max_body_bytes", "65536", "--drain_timeout", "60"), timeout=300)
    report: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, "
                              f"{os.cpu_count()} cores", "folder": folder, "clients": clients, "seconds": seconds,
                              "specs": len(specs)}
    counts = {"completed": 0, "mismatched": 0, "disconnected": 0, "queue_full_503": 0, "malformed_refused": 0,
              "unexpected": 0}
    problems: List[str] = []
    lock = threading.Lock()
    try:
        solo = [call(server.url, spec, stream=False) for spec in specs]  # warm-up too
        for i, s in enumerate(solo):
            if s["status"] != 200:
                raise SystemExit(f"spec {i} failed alone: {s}")
        rss_start = rss_kib(server.proc.pid)

        def check(i: int, got: Dict[str, Any], disconnect: bool) -> None:
            with lock:
                if got["status"] == 503 and got.get("retry_after") and (got.get("error") or {}).get(
                        "code") == "server_busy":
                    counts["queue_full_503"] += 1
                elif got["status"] != 200 or got.get("error"):
                    counts["unexpected"] += 1
                    problems.append(f"spec {i}: {got['status']} {got.get('error')}")
                elif got.get("disconnected"):
                    counts["disconnected"] += 1
                elif {k: tuple(v) for k, v in got["choices"].items()} == \
                        {k: tuple(v) for k, v in solo[i]["choices"].items()}:
                    counts["completed"] += 1
                else:
                    counts["mismatched"] += 1
                    problems.append(f"spec {i}: {got['choices']} != solo {solo[i]['choices']}")

        end = time.time() + seconds
        # a burst past the queue bound: more requests at once than the rows and the queue hold, so some are refused
        # with 503 whatever the engine's pace (without it a refusal came only from a disconnected stream's row still
        # held when its client sent the next request: a fast engine under the test suite's load saw none)
        burst_size = int(httpx.get(server.url + "/health").json()["rows"]) + 2 + 2  # rows, --max_queue 2, 2 more

        def burst(local: random.Random) -> None:
            picks = [local.randrange(len(specs)) for _ in range(burst_size)]
            sent = [threading.Thread(target=lambda i=i: check(i, call(server.url, specs[i], stream=False), False))
                    for i in picks]
            for t in sent:
                t.start()
            for t in sent:
                t.join()

        def client(k: int) -> None:
            local = random.Random(seed * 1000 + k)
            while time.time() < end:
                roll = local.random()
                if roll < 0.08:  # a malformed body
                    raw, want = local.choice(MALFORMED)
                    r = httpx.post(server.url + "/v1/completions", content=raw, timeout=60)
                    with lock:
                        if r.status_code == want:
                            counts["malformed_refused"] += 1
                        else:
                            counts["unexpected"] += 1
                            problems.append(f"malformed {raw[:40]!r}: {r.status_code}, wanted {want}")
                    continue
                if roll < 0.1:
                    burst(local)
                    continue
                i = local.randrange(len(specs))
                disconnect = roll < 0.2 and specs[i]["stream"]
                check(i, call(server.url, specs[i], disconnect=disconnect), disconnect)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deadline = time.time() + 60
        while True:  # disconnected streams free their rows at the engine's next step
            health = httpx.get(server.url + "/health").json()
            if health["rows_busy"] == 0 and health["waiting"] == 0 or time.time() > deadline:
                break
            time.sleep(0.1)
        report["rows_busy_after"], report["waiting_after"] = health["rows_busy"], health["waiting"]
        rss_end = rss_kib(server.proc.pid)
        report.update(rss_start_mib=rss_start / 1024, rss_end_mib=rss_end / 1024,
                      rss_growth_pct=100.0 * (rss_end - rss_start) / rss_start)

        # SIGTERM with streams open: each ends with its finish (its solo text) or a server_shutdown error
        streams = [i for i, s in enumerate(specs) if s["stream"]][:4]
        results: Dict[int, Dict[str, Any]] = {}
        threads = [threading.Thread(target=lambda i=i: results.update({i: call(server.url, specs[i])}))
                   for i in streams]
        for t in threads:
            t.start()
        time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        ended = {"finished": 0, "cut_by_drain_timeout": 0, "refused_draining": 0, "other": 0}
        for i, got in results.items():
            if got.get("error", {}) and got["error"].get("code") == "server_shutdown":
                ended["cut_by_drain_timeout"] += 1
            elif got["status"] == 503 and (got.get("error") or {}).get("code") == "server_draining":
                ended["refused_draining"] += 1  # it arrived after the signal
            elif got["status"] == 200 and {k: tuple(v) for k, v in got["choices"].items()} == \
                    {k: tuple(v) for k, v in solo[i]["choices"].items()}:
                ended["finished"] += 1
            else:
                ended["other"] += 1
                problems.append(f"at SIGTERM, spec {i}: {got}")
        report["sigterm"] = dict(ended, exit_code=server.proc.wait(timeout=120))
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.log.close()
    report.update(counts)
    report["problems"] = problems[:20]
    report["ok"] = (counts["mismatched"] == 0 and counts["unexpected"] == 0 and report["rows_busy_after"] == 0
                    and report["waiting_after"] == 0 and report["sigterm"]["exit_code"] == 0
                    and report["sigterm"]["other"] == 0 and report["rss_growth_pct"] <= rss_tolerance)
    return report


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_dir", required=True, help="a folder with chunk graphs (--batch_size 4 or more)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="soak_work", help="the server's log goes here")
    p.add_argument("--rss_tolerance", type=float, default=2.0, help="percent RSS growth allowed (default 2)")
    p.add_argument("--output", default=os.path.join(HERE, "results", "soak.json"),
                   help="write the report as JSON here (default: benchmarks/results/soak.json)")
    args = p.parse_args(argv)
    report = soak(args.model_dir, args.clients, args.minutes * 60, args.seed, args.work,
                  rss_tolerance=args.rss_tolerance)
    print(f"{report['date']}, {report['machine']}: {args.clients} clients, {args.minutes:g} min")
    print(f"  completed and equal to solo: {report['completed']}, mismatched: {report['mismatched']}, "
          f"disconnected: {report['disconnected']}, queue-full 503: {report['queue_full_503']}, malformed refused: "
          f"{report['malformed_refused']}, unexpected: {report['unexpected']}")
    print(f"  after the load: {report['rows_busy_after']} rows busy, {report['waiting_after']} waiting; RSS "
          f"{report['rss_start_mib']:.0f} -> {report['rss_end_mib']:.0f} MiB ({report['rss_growth_pct']:+.2f} %)")
    print(f"  SIGTERM with streams open: {report['sigterm']}")
    for problem in report["problems"]:
        print(f"  problem: {problem}")
    print("verdict:", "nothing lost" if report["ok"] else "FAILED")
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
