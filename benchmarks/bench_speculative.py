"""Speculative decoding at batch 1 on the CPU: plain greedy decoding against prompt lookup and an int4 self-draft,
on input-grounded and free-generation prompts, with HF transformers' assisted generation as the reference.

    python benchmarks/bench_speculative.py --checkpoint <hf_dir> --work <dir> [--rounds 5] [--max_new_tokens 200] \
        [--lookup_k 7] [--output FILE] [--quick]

Folders: the float32 checkpoint exported as `python -m export --device cpu --seq_length 1024` (the target) and the
same with `--quantize int4` (the self-draft), <work>/<checkpoint name>-f32 and -int4, exported when missing
(--folder / --draft_folder name others). Prompts go through the chat template (`pipe.encode(text,
apply_chat_template=True)`), greedy, at most --max_new_tokens tokens, stopping at eos as a user's call would.
Two kinds of task: input-grounded (fix the typos of a paragraph, rewrite one in the passive voice, edit a code block:
the answer copies much of its input, where prompt lookup should win) and free generation (a story, explanations:
little to copy). Modes, each `pipe.generate([ids], ...)` on the `ms` backend: plain; `prompt_lookup_num_tokens=K`
(--lookup_k, default 7: K of the target's smallest score graph, 8 tokens, minus 1); `assistant_model=<int4
folder>` (the runtime's draft K: up to the smallest score graph's size - 1, starting at 5, adapted per round).

Why paired rounds: this machine's speed moves by tens of percent between minutes (bench_decode_ab.py), so each round
runs every prompt in every mode back to back, the modes' order rotated each round (plain, lookup, draft; then lookup,
draft, plain; ...), and a mode's figure against plain is the median of the per-round ratios. Per task kind and mode:
the median over rounds of generated tokens / (prefill + decode seconds) ("e2e") and of the tokens made after prefill
/ decode seconds ("decode"; the first token comes from prefill), the ratios to plain, the acceptance rate (accepted /
drafted draft tokens, all rounds), and whether every token equals plain's in the same round (greedy: it must; a
difference is printed with "!!!" and makes the exit status 1).
HF reference, in its own process (torch threads --threads, default 2): AutoModelForCausalLM float32 on the
checkpoint, `generate` plain against `generate(prompt_lookup_num_tokens=K)` on the same token ids, alternating the
same way; its decode figure subtracts a 1-token generate of the same prompt timed in the same round (HF does not
split prefill from decode). HF's lookup matches n-grams of up to 2 tokens, ours of up to 3. Reported: its ratios and
whether its tokens equal ours (float32 both, but different kernels: a near-tie may go either way; not a failure).
Writes JSON (default benchmarks/results/bench-speculative.json; --quick: bench-speculative-quick.json) and prints the
tables. --quick is a smoke run: one prompt per kind, one round, 32 tokens. Benchmarks are not tests.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # benchmark.py (machine)

MODES = ("plain", "lookup", "draft")
HF_MODES = ("plain", "lookup")

TYPO_PARAGRAPH = (
    "Last sumer our team desided to move the anual meeting from the old conference hall to the new comunity center "
    "downtown. The decision was not easy, becuase many members had atended meetings in the old hall for more then "
    "twenty years and felt atached to it. However, the old building had no elevater, the heating broke down twice "
    "during the winter, and the parking lot was allways full. The new center, on the other hand, offers bright "
    "rooms, a modern sound system, and enough parking for everyone. After a long discusion, the board voted to make "
    "the change, and the secretery sent a letter to all members explaning the reasons. Most people responded "
    "positivly, although a few still wish we had stayed in the familar place.")
ACTIVE_PARAGRAPH = (
    "The city council approved the new budget on Monday evening. The mayor presented the plan to the public a week "
    "earlier, and local reporters questioned several of its details. Engineers will repair the old bridge over the "
    "river next spring, and a private company will build a new parking garage near the train station. The council "
    "also raised the fees for street parking in the city center. Many residents criticized this decision at the "
    "meeting, but the council members defended it as necessary. The city will use the extra money to fund bus "
    "services and to plant trees along the main avenues. Volunteers from the neighborhood association will help "
    "the parks department with the planting, and students from the local college will measure the air quality "
    "before and after the project.")
CODE_BLOCK = '''```python
import csv


def load_scores(path):
    x = 0
    totals = {}
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        for row in reader:
            name = row["name"].strip()
            score = float(row["score"])
            if score < 0:
                continue
            totals[name] = totals.get(name, 0.0) + score
            x += 1
    if x == 0:
        raise ValueError("no valid rows in " + path)
    average = sum(totals.values()) / x
    best = max(totals, key=totals.get)
    print("rows read:", x)
    print("average score:", round(average, 2))
    print("best player:", best)
    return totals, x
```'''

PROMPTS: List[Dict[str, str]] = [
    {"kind": "input", "name": "fix_typos",
     "text": "Fix the spelling mistakes in this paragraph and return the corrected paragraph only:\n\n" + TYPO_PARAGRAPH},
    {"kind": "input", "name": "code_edit",
     "text": "Edit this Python code: rename the variable x to count and add a docstring to the function. Return the "
             "whole edited code block.\n\n" + CODE_BLOCK},
    {"kind": "input", "name": "passive_voice",
     "text": "Rewrite this paragraph in the passive voice:\n\n" + ACTIVE_PARAGRAPH},
    {"kind": "free", "name": "story", "text": "Write a short story about a lighthouse keeper who finds a message in a "
                                              "bottle."},
    {"kind": "free", "name": "refrigerator", "text": "Explain how a refrigerator works."},
    {"kind": "free", "name": "vaccines", "text": "Explain how vaccines train the immune system."},
]


def mode_order(r: int, modes=MODES) -> List[str]:
    """Round r's order of the modes: rotated by one each round, so no mode always runs first after another."""
    k = r % len(modes)
    return list(modes[k:] + modes[:k])


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- workers: each runs in its own process, reads its job as JSON on stdin and prints one JSON line ---------------

def worker_ours(job: Dict[str, Any]) -> Dict[str, Any]:
    from lite_runtime import pipeline

    start = time.perf_counter()
    pipe = pipeline("text_generation", model=job["folder"], backend="ms", warm_up="all", verify_checksums=False)
    # loaded once here and kept by the pipeline for every assistant_model=<that path> call; its graphs compiled now,
    # so neither the timed calls nor its idle warm-up thread (warm_up "auto" on ms) compile anything later
    draft = pipe.draft_generator(job["draft_folder"])
    for key in draft.config.graph_paths():
        draft.warm(key)
    load_s = time.perf_counter() - start
    kwargs = {"plain": {}, "lookup": {"prompt_lookup_num_tokens": job["lookup_k"]},
              "draft": {"assistant_model": job["draft_folder"]}}
    ids = {p["name"]: pipe.encode(p["text"], apply_chat_template=True) for p in job["prompts"]}
    for name, row in ids.items():
        if len(row) + job["max_new_tokens"] > pipe.seq_length:
            raise SystemExit(f"prompt {name}: {len(row)} tokens + {job['max_new_tokens']} new exceed the folder's "
                             f"seq_length {pipe.seq_length}")
    for p in job["prompts"][:2]:  # warm: every mode once (the draft's row, each graph's first real call)
        for mode in MODES:
            pipe.generate([ids[p["name"]]], max_new_tokens=8, do_sample=False, **kwargs[mode])
    runs = []
    for r in range(job["rounds"]):
        for p in job["prompts"]:
            for mode in mode_order(r):
                t = time.perf_counter()
                out = pipe.generate([ids[p["name"]]], max_new_tokens=job["max_new_tokens"], do_sample=False,
                                    **kwargs[mode])
                wall = time.perf_counter() - t
                spec = out.speculative
                runs.append({"round": r, "prompt": p["name"], "mode": mode, "new_tokens": out.new_tokens,
                             "prefill_s": out.prefill_seconds, "decode_s": out.decode_seconds, "wall_s": wall,
                             "finish": out.finish_reasons[0], "tokens": out[0][len(ids[p["name"]]):],
                             "spec": None if spec is None else {"rounds": spec.rounds, "drafted": spec.drafted,
                                                                "accepted": spec.accepted}})
                log(f"ours round {r + 1} {p['name']:>13} {mode:>6}: {out.new_tokens} tokens, "
                    f"{out.new_tokens / max(out.prefill_seconds + out.decode_seconds, 1e-9):6.1f} tok/s e2e"
                    + (f", accepted {spec.accepted}/{spec.drafted}" if spec is not None else ""))
    import cpu_kernels

    return {"load_s": load_s, "ids": ids, "runs": runs, "score_sizes": pipe.runner.score_sizes,
            "draft_score_sizes": draft.runner.score_sizes, "seq_length": pipe.seq_length,
            "eos_token_id": list(pipe.defaults.eos_token_id or ()), "kernels_isa": cpu_kernels.isa(),
            "kernels": cpu_kernels.paths(),
            "cpu_threads": pipe.config.cpu_threads}


def worker_hf(job: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(job["threads"])
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["checkpoint"], dtype=torch.float32).eval()
    load_s = time.perf_counter() - start
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None else eos
    tok = AutoTokenizer.from_pretrained(job["checkpoint"])
    template_same = {}
    for p in job["prompts"]:  # HF's own chat template encoding against ours (the runs use our ids)
        got = tok.apply_chat_template([{"role": "user", "content": p["text"]}], tokenize=True,
                                      add_generation_prompt=True)
        got = got["input_ids"] if isinstance(got, dict) or hasattr(got, "keys") else got
        template_same[p["name"]] = list(got) == job["ids"][p["name"]]

    def gen(row: List[int], new: int, mode: str):
        x = torch.tensor([row])
        extra = {"prompt_lookup_num_tokens": job["lookup_k"]} if mode == "lookup" else {}
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                                 pad_token_id=pad, **extra)
        return time.perf_counter() - t, out[0, len(row):].tolist()

    first = job["prompts"][0]["name"]
    for mode in HF_MODES:  # warm
        gen(job["ids"][first], 8, mode)
    runs = []
    for r in range(job["rounds"]):
        for p in job["prompts"]:
            row = job["ids"][p["name"]]
            one_s, _ = gen(row, 1, "plain")  # prefill and one token: what to subtract for a decode-only figure
            for mode in mode_order(r, HF_MODES):
                seconds, tokens = gen(row, job["max_new_tokens"], mode)
                runs.append({"round": r, "prompt": p["name"], "mode": mode, "new_tokens": len(tokens),
                             "seconds": seconds, "one_token_s": one_s, "tokens": tokens})
                log(f"HF   round {r + 1} {p['name']:>13} {mode:>6}: {len(tokens)} tokens, "
                    f"{len(tokens) / seconds:6.1f} tok/s e2e")
    return {"load_s": load_s, "runs": runs, "threads": torch.get_num_threads(), "eos_token_id": eos,
            "template_same_ids": template_same, "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_isa": torch.backends.cpu.get_cpu_capability()}


def run_worker(kind: str, job: Dict[str, Any]) -> Dict[str, Any]:
    """The worker in a fresh process: its progress on stderr as it goes, its result as the last stdout line."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", kind], input=json.dumps(job),
                          stdout=subprocess.PIPE, text=True, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the {kind} worker failed (exit {proc.returncode}); its traceback is above")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the driver -------------------------------------------------------------------------------------------------

def export(checkpoint: str, folder: str, quantize: Optional[str], seq_length: int) -> None:
    if os.path.isfile(os.path.join(folder, "manifest.json")):
        return
    cmd = [sys.executable, "-m", "export", "-q", "--checkpoint", checkpoint, "--output", folder, "--device", "cpu",
           "--seq_length", str(seq_length)] + (["--quantize", quantize] if quantize else [])
    log(f"exporting {folder}: {' '.join(cmd[1:])}")
    subprocess.run(cmd, cwd=ROOT, check=True)


def first_difference(a: List[int], b: List[int]) -> Optional[int]:
    n = min(len(a), len(b))
    i = next((j for j in range(n) if a[j] != b[j]), n)
    return None if i == n and len(a) == len(b) else i


def rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def median(values: List[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise_ours(ours: Dict[str, Any], prompts: List[Dict[str, str]], rounds: int) -> Dict[str, Any]:
    """Per kind (and per prompt) and mode: median e2e and decode tok/s over rounds, the median per-round ratio to
    plain, acceptance, and token identity with plain's tokens of the same round."""
    runs = {(x["round"], x["prompt"], x["mode"]): x for x in ours["runs"]}
    groups = {kind: [p["name"] for p in prompts if p["kind"] == kind] for kind in dict.fromkeys(p["kind"] for p in prompts)}
    groups.update({p["name"]: [p["name"]] for p in prompts})
    summary: Dict[str, Any] = {}
    for group, names in groups.items():
        per_round: Dict[str, List[Dict[str, float]]] = {m: [] for m in MODES}
        for r in range(rounds):
            for m in MODES:
                xs = [runs[(r, n, m)] for n in names]
                per_round[m].append({"e2e": rate(sum(x["new_tokens"] for x in xs),
                                                 sum(x["prefill_s"] + x["decode_s"] for x in xs)),
                                     "decode": rate(sum(x["new_tokens"] - 1 for x in xs), sum(x["decode_s"] for x in xs)),
                                     "tokens": sum(x["new_tokens"] for x in xs)})
        entry = {}
        for m in MODES:
            xs = [runs[(r, n, m)] for r in range(rounds) for n in names]
            spec = [x["spec"] for x in xs if x["spec"]]
            drafted, accepted = sum(s["drafted"] for s in spec), sum(s["accepted"] for s in spec)
            same = [x["tokens"] == runs[(x["round"], x["prompt"], "plain")]["tokens"] for x in xs]
            entry[m] = {"e2e_tok_s": median([p["e2e"] for p in per_round[m]]),
                        "decode_tok_s": median([p["decode"] for p in per_round[m]]),
                        "e2e_ratio": median([rate(p["e2e"], q["e2e"]) for p, q in zip(per_round[m], per_round["plain"])]),
                        "decode_ratio": median([rate(p["decode"], q["decode"])
                                                for p, q in zip(per_round[m], per_round["plain"])]),
                        "tokens_per_round": [p["tokens"] for p in per_round[m]],
                        "spec_rounds": sum(s["rounds"] for s in spec), "drafted": drafted, "accepted": accepted,
                        "acceptance": accepted / drafted if drafted else None,
                        "same_tokens_as_plain": all(same), "runs_differing": same.count(False),
                        "per_round": per_round[m]}
        summary[group] = entry
    return summary


def summarise_hf(hf: Dict[str, Any], ours: Dict[str, Any], prompts: List[Dict[str, str]], rounds: int) -> Dict[str, Any]:
    runs = {(x["round"], x["prompt"], x["mode"]): x for x in hf["runs"]}
    plain_ours = {x["prompt"]: x["tokens"] for x in ours["runs"] if x["mode"] == "plain" and x["round"] == 0}
    groups = {kind: [p["name"] for p in prompts if p["kind"] == kind] for kind in dict.fromkeys(p["kind"] for p in prompts)}
    groups.update({p["name"]: [p["name"]] for p in prompts})
    summary: Dict[str, Any] = {}
    for group, names in groups.items():
        per_round: Dict[str, List[Dict[str, float]]] = {m: [] for m in HF_MODES}
        for r in range(rounds):
            for m in HF_MODES:
                xs = [runs[(r, n, m)] for n in names]
                per_round[m].append({"e2e": rate(sum(x["new_tokens"] for x in xs), sum(x["seconds"] for x in xs)),
                                     "decode": rate(sum(x["new_tokens"] - 1 for x in xs),
                                                    sum(max(x["seconds"] - x["one_token_s"], 1e-9) for x in xs))})
        entry = {}
        for m in HF_MODES:
            xs = [runs[(r, n, m)] for r in range(rounds) for n in names]
            entry[m] = {"e2e_tok_s": median([p["e2e"] for p in per_round[m]]),
                        "decode_tok_s": median([p["decode"] for p in per_round[m]]),
                        "e2e_ratio": median([rate(p["e2e"], q["e2e"]) for p, q in zip(per_round[m], per_round["plain"])]),
                        "decode_ratio": median([rate(p["decode"], q["decode"])
                                                for p, q in zip(per_round[m], per_round["plain"])]),
                        "same_tokens_as_hf_plain": all(x["tokens"] == runs[(x["round"], x["prompt"], "plain")]["tokens"]
                                                       for x in xs),
                        "same_tokens_as_ours": all(x["tokens"] == plain_ours[x["prompt"]] for x in xs),
                        "per_round": per_round[m]}
        summary[group] = entry
    return summary


def differences(ours: Dict[str, Any], hf: Optional[Dict[str, Any]], tokenizer) -> List[Dict[str, Any]]:
    """Every run whose tokens are not plain's (ours: in the same round; plain: against round 0's plain; HF: against
    ours), with the first differing position and a little decoded text either side of it."""
    def show(tokens, i):
        return tokenizer.decode(tokens[max(0, i - 8):i + 8])

    plain = {(x["round"], x["prompt"]): x["tokens"] for x in ours["runs"] if x["mode"] == "plain"}
    found = []
    for x in ours["runs"]:
        ref = plain[(0, x["prompt"])] if x["mode"] == "plain" else plain[(x["round"], x["prompt"])]
        i = first_difference(ref, x["tokens"])
        if i is not None:
            found.append({"engine": "ours", "round": x["round"], "prompt": x["prompt"], "mode": x["mode"],
                          "against": "ours plain, round 1" if x["mode"] == "plain" else "ours plain, same round",
                          "first_difference": i, "lengths": [len(ref), len(x["tokens"])],
                          "reference_text": show(ref, i), "text": show(x["tokens"], i)})
    for x in (hf or {}).get("runs", []):
        ref = plain[(0, x["prompt"])]
        i = first_difference(ref, x["tokens"])
        if i is not None:
            found.append({"engine": "hf", "round": x["round"], "prompt": x["prompt"], "mode": x["mode"],
                          "against": "ours plain, round 1", "first_difference": i,
                          "lengths": [len(ref), len(x["tokens"])], "reference_text": show(ref, i),
                          "text": show(x["tokens"], i)})
    return found


def fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return f"{v:.{digits}f}"


def print_tables(report: Dict[str, Any]) -> None:
    s = report["settings"]
    print(f"\n{report['date']}, {report['machine']}; {os.path.basename(report['folder'])} (target) and "
          f"{os.path.basename(report['draft_folder'])} (draft), backend ms, batch 1, greedy, max_new_tokens "
          f"{s['max_new_tokens']}, {s['rounds']} round(s), prompt lookup K {s['lookup_k']}, draft K up to "
          f"{report['draft_k_max']} (from 5)")
    groups = list(report["ours"])
    kinds = [g for g in groups if g in ("input", "free")]
    print("\nours (median over rounds; ratio: median of per-round ratios to plain)")
    print("| task | mode | e2e tok/s | decode tok/s | e2e ratio | decode ratio | acceptance | drafted | tokens = plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for g in kinds + [g for g in groups if g not in kinds]:
        for m, e in report["ours"][g].items():
            label = g if g in kinds else f"  {g}"
            print(f"| {label} | {m} | {fmt(e['e2e_tok_s'])} | {fmt(e['decode_tok_s'])} | {fmt(e['e2e_ratio'], 2)} | "
                  f"{fmt(e['decode_ratio'], 2)} | {fmt(e['acceptance'], 2)} | {e['drafted'] or '-'} | "
                  f"{fmt(e['same_tokens_as_plain'])} |")
    if report.get("hf"):
        print(f"\nHF transformers {report['hf_info']['version']} (torch {report['hf_info']['torch']}, "
              f"{report['hf_info']['threads']} threads): plain generate against prompt_lookup_num_tokens="
              f"{s['lookup_k']}; decode tok/s: minus a 1-token generate")
        print("| task | mode | e2e tok/s | decode tok/s | e2e ratio | decode ratio | tokens = HF plain | tokens = ours |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for g in kinds + [g for g in report["hf"] if g not in kinds]:
            for m, e in report["hf"][g].items():
                label = g if g in kinds else f"  {g}"
                print(f"| {label} | {m} | {fmt(e['e2e_tok_s'])} | {fmt(e['decode_tok_s'])} | {fmt(e['e2e_ratio'], 2)} "
                      f"| {fmt(e['decode_ratio'], 2)} | {fmt(e['same_tokens_as_hf_plain'])} | "
                      f"{fmt(e['same_tokens_as_ours'])} |")
        print("ours against HF, e2e tok/s of the same mode (median):")
        for g in kinds:
            for m in HF_MODES:
                a, b = report["ours"][g][m]["e2e_tok_s"], report["hf"][g][m]["e2e_tok_s"]
                print(f"  {g} {m}: ours / HF {fmt(rate(a, b), 2)}")
    for d in report["differences"]:
        loud = "!!! " if d["engine"] == "ours" else "note: "
        print(f"{loud}{d['engine']} {d['mode']} tokens differ from {d['against']}: prompt {d['prompt']}, round "
              f"{d['round'] + 1}, first at generated token {d['first_difference']} (lengths {d['lengths']}): "
              f"{d['reference_text']!r} vs {d['text']!r}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="/tmp/ppl/smollm2", help="HF float32 checkpoint (default: %(default)s, "
                                                                     "SmolLM2-135M-Instruct)")
    p.add_argument("--work", default="/work/s33", help="where the folders are, or are exported (default: %(default)s)")
    p.add_argument("--folder", help="the float32 target folder (default: <work>/<checkpoint name>-f32)")
    p.add_argument("--draft_folder", help="the int4 draft folder (default: <work>/<checkpoint name>-int4)")
    p.add_argument("--seq_length", type=int, default=1024, help="--seq_length of folders exported here")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--lookup_k", type=int, default=7, help="prompt_lookup_num_tokens, ours and HF's (default 7)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the HF reference (default 2)")
    p.add_argument("--no_hf", action="store_true", help="leave out the HF transformers reference")
    p.add_argument("--quick", action="store_true", help="smoke run: one prompt per kind, one round, 32 tokens")
    p.add_argument("--output", help="JSON to write (default: benchmarks/results/bench-speculative.json, or "
                                    "bench-speculative-quick.json with --quick)")
    p.add_argument("--worker", choices=("ours", "hf"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        job = json.loads(sys.stdin.read())
        print(json.dumps(worker_ours(job) if args.worker == "ours" else worker_hf(job)))
        return 0

    if args.quick:
        args.rounds, args.max_new_tokens = 1, 32
    prompts = [q for q in PROMPTS if not args.quick or q["name"] in ("fix_typos", "story")]
    name = os.path.basename(os.path.normpath(args.checkpoint))
    folder = args.folder or os.path.join(args.work, f"{name}-f32")
    draft_folder = args.draft_folder or os.path.join(args.work, f"{name}-int4")
    export(args.checkpoint, folder, None, args.seq_length)
    export(args.checkpoint, draft_folder, "int4", args.seq_length)

    import benchmark
    from lite_runtime.tokenizer import FolderTokenizer

    started = time.perf_counter()
    job = {"folder": folder, "draft_folder": draft_folder, "prompts": prompts, "rounds": args.rounds,
           "max_new_tokens": args.max_new_tokens, "lookup_k": args.lookup_k}
    log(f"measuring ours: {len(prompts)} prompts x {len(MODES)} modes x {args.rounds} round(s)")
    ours = run_worker("ours", job)
    hf = None
    if not args.no_hf:
        log(f"measuring HF transformers: {len(prompts)} prompts x {len(HF_MODES)} modes x {args.rounds} round(s)")
        hf = run_worker("hf", {**job, "checkpoint": args.checkpoint, "ids": ours["ids"], "threads": args.threads})
    tokenizer = FolderTokenizer(folder)
    report: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": benchmark.machine(), "checkpoint": args.checkpoint,
        "folder": folder, "draft_folder": draft_folder, "settings": {k: v for k, v in vars(args).items() if k != "worker"},
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "draft_k_max": ours["draft_score_sizes"][0] - 1 if ours["draft_score_sizes"] else None,
        "target_score_sizes": ours["score_sizes"], "kernels_isa": ours["kernels_isa"],
        "kernels": ours.get("kernels"), "ours_load_s": ours["load_s"],
        "prompts": [{**q, "prompt_tokens": len(ours["ids"][q["name"]]),
                     "plain_text": tokenizer.decode(next(x["tokens"] for x in ours["runs"]
                                                         if x["prompt"] == q["name"] and x["mode"] == "plain"),
                                                    skip_special_tokens=True)} for q in prompts],
        "ours": summarise_ours(ours, prompts, args.rounds),
        "hf": summarise_hf(hf, ours, prompts, args.rounds) if hf else None,
        "hf_info": {"version": hf["transformers"], "torch": hf["torch"], "threads": hf["threads"],
                    "torch_isa": hf["torch_isa"], "load_s": hf["load_s"],
                    "template_same_ids": hf["template_same_ids"]} if hf else None,
        "differences": differences(ours, hf, tokenizer),
        "runs": {"ours": [{k: v for k, v in x.items() if k != "tokens"} for x in ours["runs"]],
                 "hf": [{k: v for k, v in x.items() if k != "tokens"} for x in hf["runs"]] if hf else None},
    }
    report["seconds"] = time.perf_counter() - started
    print_tables(report)
    path = args.output or os.path.join(RESULTS, "bench-speculative-quick.json" if args.quick
                                       else "bench-speculative.json")
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"wrote {path} ({report['seconds']:.0f} s)")
    bad = [d for d in report["differences"] if d["engine"] == "ours"]
    if bad:
        print(f"!!! {len(bad)} run(s) of ours did not reproduce plain greedy decoding's tokens (above)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
