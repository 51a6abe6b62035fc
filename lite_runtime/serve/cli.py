"""Loading a folder for serving, and the command line (`python -m lite_runtime.serve`)."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
import time
from typing import Any, List, Optional

from lite_runtime.errors import InferError
from lite_runtime.folder import graph_key

API_KEY_ENV = "MSLITE_LLM_API_KEY"
log = logging.getLogger("lite_runtime.serve")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_service(model_dir: str, backend: str = "auto", api_key: Optional[str] = None, max_queue: int = 64,
                 model_name: Optional[str] = None, metrics_public: bool = False, max_body_bytes: Optional[int] = None,
                 request_timeout: Optional[float] = None, prefill_chunk: Optional[int] = None,
                 prefix_reuse: bool = True, speculative: str = "auto", draft_model: Optional[str] = None,
                 speculative_tokens: Optional[int] = None, reasoning_parser: str = "auto",
                 max_reasoning_tokens: Optional[int] = None, **config: Any):
    """Load the folder's chunk and inc graphs (all the server runs), compile them, start the engine."""
    from lite_runtime import InferConfig, pipeline
    from lite_runtime.engine.scheduler import BatchEngine
    from lite_runtime.serve.serving import Service

    if not os.path.isdir(model_dir):
        raise InferError(f"{model_dir}: not a model folder; pass a folder written by python -m export")
    settings = InferConfig.from_folder(model_dir, backend=backend, warm_up="none", chunk_graphs=True,
                                       prefill_graphs=False, **config)
    if settings.tp_size > 1:  # refused before anything is loaded (the folder's manifest is read once, here)
        raise InferError(f"{model_dir}: a tensor-parallel folder ({settings.tp_size} ranks) cannot be served yet: "
                         "every rank has to take every step, and the server drives one process; run it with "
                         "pipeline() or scripts/run_infer_main.py under msrun (README, \"Two cards\")")
    generator = pipeline("text_generation", model=settings)
    reasoning = reasoning_parser_of(generator, reasoning_parser)  # refused before any graph compiles
    if max_reasoning_tokens is not None and (reasoning is None or max_reasoning_tokens < 0):
        raise InferError(f"--max_reasoning_tokens {max_reasoning_tokens}: " + (
            "must be >= 0" if reasoning is not None else "this folder's model does not reason (no reasoning "
            "parser: its chat template has no <think> block, or --reasoning_parser none); drop the flag"))
    draft = None
    if speculative not in ("auto", "off", "prompt_lookup", "draft"):
        raise InferError(f"--speculative {speculative!r} is not one of auto, off, prompt_lookup, draft")
    if speculative == "auto":  # prompt lookup where it was measured to pay (docs/serving.md, "Speculative decoding")
        speculative = "prompt_lookup" if lookup_pays(generator.config) and generator.runner.score_sizes \
            and not draft_model else 'off'
    if speculative == "draft" or draft_model:
        if not draft_model:
            raise InferError("--speculative draft needs --draft_model <folder> (the same tokenizer)")
        speculative = "draft"
        draft = generator.draft_generator(draft_model)  # refused here when its tokenizer is not the model's
    if speculative != "off" and not generator.runner.score_sizes:
        raise InferError(generator.runner.missing("score"))
    if speculative_tokens is not None and generator.runner.score_sizes and \
            not 1 <= speculative_tokens <= generator.runner.score_sizes[-1] - 1:
        raise InferError(f"--speculative_tokens {speculative_tokens} must be between 1 and "
                         f"{generator.runner.score_sizes[-1] - 1} (the folder's largest score graph checks that many)")
    engine = BatchEngine(generator, max_queue=max_queue, prefill_chunk=prefill_chunk, prefix_reuse=prefix_reuse,
                         speculative_tokens=speculative_tokens)  # a folder without chunk graph:
    try:                                                                                # refused, with what to do
        start = time.perf_counter()
        runner = generator.runner
        keys = [graph_key("chunk", n) for n in runner.chunk_sizes] + list(runner.step_graphs.values())
        for key in keys:  # compiled before it listens
            generator.warm(key)
        log.info("%s backend: %d graph(s) warmed up in %.2f s (%s)", generator.backend_name, len(keys),
                 time.perf_counter() - start, ", ".join(keys))
        generator.tokenizer  # noqa: B018  (load it now, not in the first request)
    except BaseException:
        engine.stop()
        raise
    # the folder's own name (manifest.json, set by export --name: a renamed directory keeps it), also answered to
    # by the directory's name; --model_name replaces the first (vLLM's --served-model-name takes several likewise)
    recorded = generator.config.folder.name if generator.config.folder else None
    directory = os.path.basename(os.path.normpath(model_dir))
    from lite_runtime.serve.serving import MAX_BODY_BYTES

    service = Service(generator, engine, model_name or recorded or directory, api_key, metrics_public=metrics_public,
                      max_body_bytes=max_body_bytes or MAX_BODY_BYTES, request_timeout=request_timeout,
                      aliases=[n for n in (recorded, directory) if n],
                      speculative=None if speculative == "off" else speculative, draft=draft,
                      reasoning=reasoning, thinking_budget=max_reasoning_tokens)
    if reasoning is not None:
        fmt = reasoning[0]
        log.info("reasoning parser %s: chat answers carry the model's thinking (%s ... %s) as reasoning_content",
                 fmt.name, fmt.start, fmt.end)
    warning = service.chat_warning()
    if warning:
        log.warning(warning)
    return service


def reasoning_parser_of(generator, choice: str = "auto"):
    """(the folder's reasoning format, its markers' ids) (lite_runtime/reasoning.py), or None; an InferError when
    `choice` names a parser its chat template cannot use, or when decoding drops the markers (ThinkTokens.of)."""
    from lite_runtime.reasoning import ThinkTokens, reasoning_format

    template = getattr(generator.tokenizer, "chat_template", None)
    fmt = reasoning_format(template if isinstance(template, str) else None, generator.config.model_name, choice)
    return None if fmt is None else (fmt, ThinkTokens.of(generator.tokenizer, fmt))


def lookup_pays(config) -> bool:
    """Whether `--speculative auto` turns prompt lookup on for this folder: CPU folders of float32 or bfloat16 weights,
    where rewriting or editing a text went 1.85x (float32 SmolLM2) and 1.9x (bfloat16 SmolLM2 on the server's path,
    2.0x through generate with the AVX512-BF16 form, 1.48x with float32's, 1.92x natively on an AVX2-only Zen 3: a
    verify of 8 costs 1.7 steps there since the head leaves out the graph's zero rows; free generation 0.93-1.06x,
    docs/performance.md "Speculative decoding"); int8 CPU folders (fixing typos 1.52x on the server's path with the
    banded AVX-512 VNNI form, free generation 0.95x; on an AVX2-only Zen 3 input-grounded 1.35-1.42x through generate,
    fixing typos 1.33x on the server's path, free 0.95-0.97x, since the head's zero rows and the K each round's
    measured verify cost picks: performance-log 65, 1.00x before); int4 CPU folders where their matrices are banded
    on AVX-512 VNNI (since direct steps: SmolLM2 input-grounded 1.67x through generate, fixing typos 1.83x on the
    server's path, free generation 0.96x at worst; performance-log 63). Not on float16 folders, int8 ones on NEON or
    the plain C++ form (not measured), int4 ones on AVX2 (1.04x input-grounded, 0.94x free on the Zen 3: the same
    prompts' answers copied little; performance-log 65), nor on Atlas (not measured); `--speculative prompt_lookup`
    turns it on anywhere."""
    folder = config.folder
    quantization = folder.quantization if folder is not None else None
    if config.target != "CPU" or config.dtype not in ("float32", "bfloat16"):
        return False
    if quantization is None:
        return True
    if quantization.get("bits") not in (4, 8):
        return False
    try:
        import cpu_kernels
    except ImportError:
        return False
    if quantization.get("bits") == 8:  # the x86 forms, where it was measured (not NEON or plain C++)
        return cpu_kernels.quant_form() in ("avx2", "avx512_vnni")
    return cpu_kernels.quant_form() == "avx512_vnni" and cpu_kernels.bands_here(4)


def draining_server(uvicorn, config, service, drain_timeout: float):
    """A uvicorn.Server whose first SIGTERM / SIGINT drains (Service.drain, in a thread: the event loop keeps
    answering, with 503s for new requests) and then exits; a second signal exits at once. The process exits 0:
    the signal is not raised again after the drain, as uvicorn otherwise does."""
    import threading

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if service.draining:  # the second signal: now
                self.should_exit = self.force_exit = True
                return
            log.warning("signal %s: draining (up to %g s for the %d request(s) in flight), then exiting", sig,
                        drain_timeout, service.engine.inflight)
            service.draining = True

            def drain() -> None:
                cut = not service.drain(drain_timeout)
                log.warning("drained%s; exiting", ": requests past the timeout were ended" if cut else "")
                self.should_exit = True

            threading.Thread(target=drain, name="mslite-llm-drain", daemon=True).start()

    return Draining(config)


def build_parser() -> argparse.ArgumentParser:
    from lite_runtime.backends import CHOICES

    p = argparse.ArgumentParser(prog="python -m lite_runtime.serve",
                                description="An OpenAI-compatible HTTP server for a model folder")
    p.add_argument("--model_dir", required=True, help="model folder written by python -m export")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", choices=CHOICES, default="auto",
                   help="mslite (Atlas, GE), ms (MindSpore, CPU) or auto: mslite when importable (default)")
    p.add_argument("--api_key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health and /docs "
                        f"(or set {API_KEY_ENV})")
    p.add_argument("--metrics_public", action="store_true",
                   help="serve GET /metrics without the API key (for a Prometheus scraper without one)")
    p.add_argument("--max_body_bytes", type=int, default=8 << 20,
                   help="a request body larger than this is a 413, never read (default: 8 MiB)")
    p.add_argument("--request_timeout", type=float, default=None,
                   help="seconds a request may take from its submission to the engine, waiting for a row included; "
                        "past it, 504 (or an error event in a stream) and its row is freed (default: no limit)")
    p.add_argument("--drain_timeout", type=float, default=30.0,
                   help="on SIGTERM / SIGINT: seconds the running requests may still take; new ones get 503 "
                        "meanwhile, the rest are then ended with an error their clients see; exit 0 (default: 30)")
    p.add_argument("--max_queue", type=int, default=64,
                   help="requests that may wait for a free row; past it, 503 with Retry-After (default: 64)")
    p.add_argument("--prefill_chunk", type=int, default=None,
                   help="prompt tokens prefilled per engine step while other requests generate, the step's token "
                        "budget (default: the folder's largest chunk graph, python -m export --chunk_sizes: prompt "
                        "throughput and time to first token first, as vLLM and llama-server; a smaller one, down to "
                        "the smallest chunk graph, shortens what a running stream waits between two tokens while a "
                        "prompt goes in)")
    p.add_argument("--prefix_reuse", choices=("on", "off"), default="on",
                   help="on (default): prefix caching: a prompt whose leading full KV blocks some request computed "
                        "(a shared system prompt, a chat's previous turn; running or finished and not yet reused) "
                        "shares those blocks and prefills only the rest; off: every prompt is prefilled whole (one user's prompt then never shortens another's time to first token)")
    p.add_argument("--speculative", choices=("auto", "off", "prompt_lookup", "draft"), default="auto",
                   help="speculative decoding while one request decodes alone: prompt_lookup drafts from the "
                        "request's own text (rewrites, edits, code: 1.85x on SmolLM2), draft from --draft_model; "
                        "checked by the folder's score graphs, held to a loss budget where drafts fail (3 %% of a "
                        "request's time); answers are token for token the same. auto (default): prompt_lookup on "
                        "CPU folders of float32 or bfloat16 weights (where it was measured to pay), else off. A request's "
                        "\"speculative\": false declines, true asks")
    p.add_argument("--draft_model", default=None,
                   help="a draft folder with the same tokenizer, e.g. the model's own int4 export (implies "
                        "--speculative draft)")
    p.add_argument("--speculative_tokens", type=int, default=None,
                   help="draft tokens per check at most (default: the folder's smallest score graph's size - 1)")
    p.add_argument("--reasoning_parser", choices=("auto", "none", "qwen3", "deepseek_r1"), default="auto",
                   help="reasoning models: the thinking (<think> ... </think>) is returned as "
                        "message.reasoning_content (and .reasoning), the answer as content. auto (default): on when "
                        "the folder's chat template has the markers (Qwen3, DeepSeek-R1 distills); none: the whole "
                        "text is content")
    p.add_argument("--max_reasoning_tokens", type=int, default=None,
                   help="a thinking budget for every chat request (a request's max_reasoning_tokens or "
                        "reasoning_budget wins): at this many reasoning tokens the block is closed and the model "
                        "answers (default: no limit)")
    p.add_argument("--model_name", default=None,
                   help="the model id /v1/models lists and responses carry (default: the folder's name as exported, "
                        "python -m export --name; requests may also use that name and the folder's directory name)")
    from lite_runtime.engine.kv_pool import add_pool_arguments

    add_pool_arguments(p)
    p.add_argument("--device_id", type=int, default=0)
    p.add_argument("--log_level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError:
        print('error: the server needs FastAPI, uvicorn and prometheus-client: pip install -e ".[serve]"',
              file=sys.stderr)
        return 2
    from lite_runtime.serve.app import create_app

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not is_loopback(args.host) and not api_key:
        print(f"warning: listening on {args.host} without an API key: anyone who can reach this port can use the "
              f"model. Pass --api_key or set {API_KEY_ENV}.", file=sys.stderr, flush=True)
    if args.max_queue < 0:
        print("error: --max_queue must be >= 0", file=sys.stderr)
        return 2
    try:
        service = load_service(args.model_dir, backend=args.backend, api_key=api_key, max_queue=args.max_queue,
                               model_name=args.model_name, metrics_public=args.metrics_public,
                               max_body_bytes=args.max_body_bytes, request_timeout=args.request_timeout,
                               prefill_chunk=args.prefill_chunk, prefix_reuse=args.prefix_reuse == "on",
                               speculative=args.speculative, draft_model=args.draft_model,
                               speculative_tokens=args.speculative_tokens,
                               reasoning_parser=args.reasoning_parser, max_reasoning_tokens=args.max_reasoning_tokens,
                               device_id=args.device_id, num_blocks=args.num_blocks,
                               kv_cache_memory=args.kv_cache_memory)
    except InferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    g = service.generator
    print(f"serving {service.model_name} on http://{args.host}:{args.port}/v1 (backend {g.backend_name}, "
          f"{g.batch_size} sequence(s) a step, up to {g.seq_length} tokens each{', API key required' if api_key else ''})",
          file=sys.stderr, flush=True)
    print(g.runner.pool_plan.line(), file=sys.stderr, flush=True)
    try:
        config = uvicorn.Config(create_app(service), host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=10)
        draining_server(uvicorn, config, service, args.drain_timeout).run()
    finally:
        service.engine.stop()
    return 0
