"""Speculative decoding on the server's path (BatchEngine, no HTTP): one request alone, prompt lookup on and off
alternating (3 paired rounds after a warm pair), tokens checked equal; SmolLM2-135M-Instruct float32 folder.

    python benchmarks/bench_speculative_serve.py [FOLDER]   (default /work/s33/smollm2-f32, from bench_speculative.py)

Prints tok/s of each run (submission to end, prefill included) and the median ratio on/off per prompt.
"""
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_speculative import TYPO_PARAGRAPH
from lite_runtime import pipeline
from lite_runtime.engine.scheduler import BatchEngine, SlotRequest
from lite_runtime.engine.speculative import PromptLookup
gen = pipeline("text_generation", model=sys.argv[1] if len(sys.argv) > 1 else "/work/s33/smollm2-f32", backend="ms", warm_up="all", chunk_graphs=True)
eng = BatchEngine(gen)
prompts = {"fix_typos": "Fix the typos in this paragraph and return it:\n\n" + TYPO_PARAGRAPH,
           "story": "Write a short story about a lighthouse keeper who finds a message in a bottle."}
def run(text, spec):
    ids = gen.encode(text, apply_chat_template=True)
    done = threading.Event()
    req = SlotRequest(prompt=ids, max_tokens=200, settings=gen.defaults, emit=lambda e: done.set() if e[0] in ("end", "error") else None,
                      eos=tuple(gen.defaults.eos_token_id or ()), proposer=PromptLookup() if spec else None)
    t = time.perf_counter(); eng.submit(req); done.wait(); dt = time.perf_counter() - t
    return len(req.generated) / dt, req.generated, (req.spec_drafted, req.spec_accepted)
for name, text in prompts.items():
    run(text, False); run(text, True)
    ratios = []
    for rnd in range(3):
        a = run(text, rnd % 2 == 0); b = run(text, rnd % 2 == 1)
        on, off = (a, b) if rnd % 2 == 0 else (b, a)
        assert on[1] == off[1], "tokens differ"
        ratios.append(on[0] / off[0])
        print(name, f"off {off[0]:.1f} tok/s, on {on[0]:.1f} tok/s, drafted/accepted {on[2]}", flush=True)
    print(name, "median ratio", round(statistics.median(ratios), 3), flush=True)
eng.stop()
