"""The launcher: run a model folder (or two graph files) for one --prompt, or an interactive loop until EOF or `exit`.

    python scripts/run_infer_main.py --model_dir model_dirs/qwen2-tiny --backend ms --prompt "Hello"

scripts/run_infer_main.py calls main() here. Arguments keep the names of MindFormers' run_infer_main.py; --backend,
--chat and --check are new. `--check` replays the folder's golden references instead of generating
(python -m lite_runtime.check). Each request prints a timing line: prefill milliseconds and decode tokens per second.
Like the rest of lite_runtime, importing it loads no engine: pipeline() imports the backend's.
"""
from __future__ import annotations

import argparse
import logging
import sys
import threading
from typing import List, Optional

from lite_runtime import InferError, TextIteratorStreamer, pipeline
from lite_runtime.backends import CHOICES
from lite_runtime.config import WARM_UP

DESCRIPTION = "Run a model folder (or two graph files): one --prompt and exit, or an interactive loop until EOF or `exit`."


def str2bool(value: str) -> bool:
    low = str(value).lower()
    if low in ("true", "1", "yes", "y", "on"):
        return True
    if low in ("false", "0", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _flag(p: argparse.ArgumentParser, name: str, help_text: str) -> None:
    """A boolean that takes `--x`, `--x true` or `--x false` (MindFormers wrote `--x True`)."""
    p.add_argument(name, type=str2bool, nargs="?", const=True, default=False, help=help_text + " (default: false)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run_infer_main.py", description=DESCRIPTION)
    p.add_argument("--model_dir", help="model folder written by python -m export (preferred)")
    p.add_argument("--prefill_model_path", help="full graph, when not using --model_dir")
    p.add_argument("--increment_model_path", help="incremental graph, when not using --model_dir")
    p.add_argument("--config_path", help="GE config.ini (default: the folder's)")
    p.add_argument("--tokenizer_path", help="tokenizer folder (default: the model folder)")
    p.add_argument("--backend", choices=CHOICES, default="auto",
                   help="mslite (Atlas, GE), ms (MindSpore, CPU) or auto: mslite when importable (default)")
    p.add_argument("--device_id", type=int, default=0)
    p.add_argument("--rank_id", type=int, default=0,
                   help="mslite, tensor-parallel folders: this process's rank (0: $RANK_ID when set)")
    p.add_argument("--rank_table_file", default=None,
                   help="mslite, tensor-parallel folders: the HCCL rank table (default: $RANK_TABLE_FILE)")
    p.add_argument("--seq_length", type=int, default=None,
                   help="the graphs' sequence length; read from the folder, needed with graph paths")
    p.add_argument("--batch_size", type=int, default=None,
                   help="the graphs' batch size; read from the folder, needed with graph paths. The prompt is "
                        "repeated to fill the batch")
    _flag(p, "--do_sample", "sample instead of greedy")
    p.add_argument("--top_k", type=int, default=None, help="keep the k most likely tokens when sampling")
    p.add_argument("--top_p", type=float, default=None, help="nucleus mass when sampling")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--repetition_penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--max_length", type=int, default=None, help="prompt plus generated tokens at most")
    p.add_argument("--max_output_length", type=int, default=None,
                   help="generated tokens at most (max_new_tokens); default: until eos or the graphs are full")
    _flag(p, "--stream", "print text as it is generated")
    _flag(p, "--chat", "wrap the prompt in the tokenizer's chat template")
    _flag(p, "--add_special_tokens", "let the tokenizer add its special tokens")
    p.add_argument("--ge_cache_dir", default=None,
                   help="mslite: where GE keeps compiled graphs, so a restart does not recompile (default "
                        "~/.cache/mslite-llm/ge, one folder per model folder content, Lite and CANN version; "
                        "'none' turns it off)")
    from lite_runtime.engine.kv_pool import add_pool_arguments

    add_pool_arguments(p)
    p.add_argument("--warm_up", choices=WARM_UP, default=None,
                   help="graphs to run once at load: auto (default): all on mslite, where GE compiles for minutes "
                        "per graph, smallest on ms; smallest: the inc graph and the smallest prefill graph; all "
                        "(longer prompt buckets then never compile inside a request); none")
    _flag(p, "--check", "instead of generating, replay the folder's golden references on this machine and report "
                        "whether it computes what the checkpoint means (python -m lite_runtime.check); exit code 0 "
                        "pass, 1 fail")
    p.add_argument("--check_json", metavar="FILE", help="with --check: also write the report as JSON to FILE")
    p.add_argument("--prompt", help="run this prompt once and exit; without it, read prompts from stdin")
    p.add_argument("-v", "--verbose", action="store_true", help="log which backend was chosen and why")
    return p


def load(args: argparse.Namespace):
    extra = {k: v for k, v in (("device_id", args.device_id), ("rank_id", args.rank_id),
                               ("tokenizer_path", args.tokenizer_path), ("ge_config_path", args.config_path),
                               ("infer_seq_length", args.seq_length), ("batch_size", args.batch_size),
                               ("warm_up", args.warm_up), ("ge_cache_dir", args.ge_cache_dir),
                               ("rank_table_file", args.rank_table_file), ("num_blocks", args.num_blocks),
                               ("kv_cache_memory", args.kv_cache_memory)) if v is not None}
    if args.model_dir:
        return pipeline("text_generation", model=args.model_dir, backend=args.backend, **extra)
    if args.prefill_model_path and args.increment_model_path:
        return pipeline("text_generation", model=(args.prefill_model_path, args.increment_model_path),
                        backend=args.backend, **extra)
    raise InferError("pass --model_dir, or both --prefill_model_path and --increment_model_path")


def generation_kwargs(args: argparse.Namespace) -> dict:
    pairs = (("do_sample", args.do_sample), ("top_k", args.top_k), ("top_p", args.top_p),
             ("temperature", args.temperature), ("repetition_penalty", args.repetition_penalty),
             ("seed", args.seed), ("max_length", args.max_length), ("max_new_tokens", args.max_output_length))
    return {k: v for k, v in pairs if v is not None}


def answer(pipe, args: argparse.Namespace, text: str) -> None:
    rows = [text] * pipe.batch_size if args.batch_size else [text]
    kwargs = dict(apply_chat_template=args.chat, add_special_tokens=args.add_special_tokens,
                  **generation_kwargs(args))
    # a tensor-parallel folder under msrun or one Lite process per rank: every rank makes the same tokens, rank 0
    # prints them (the others only their timing line)
    tp = pipe.config.tp_size
    tp_rank = int(pipe.config.rank_id) if tp > 1 else None
    show = not tp_rank
    if args.stream:
        streamer = TextIteratorStreamer(pipe.tokenizer, skip_prompt=True, skip_special_tokens=True)
        errors: List[BaseException] = []
        results: list = []

        def work() -> None:
            try:
                pipe(text, streamer=streamer, **kwargs)
                results.append(pipe.last_output)  # this thread's call (last_output is per thread)
            except BaseException as exc:  # reported in the main thread
                errors.append(exc)
                streamer.end()

        thread = threading.Thread(target=work)
        thread.start()
        for piece in streamer:
            if show:
                print(piece, end="", flush=True)
        thread.join()
        if show:
            print()
        if errors:
            raise errors[0]
        result = results[0]
    else:
        outputs = pipe(rows, **kwargs)
        for i, out in enumerate(outputs if show else []):
            print(out if len(outputs) == 1 else f"[{i}] {out}", flush=True)
        result = pipe.last_output
    rank = "" if tp_rank is None else f", rank {tp_rank} of {tp}"
    print(f"[timing] prefill {result.prefill_seconds * 1000:.1f} ms, decode "
          f"{result.decode_tokens_per_second:.1f} tok/s ({result.new_tokens} new tokens, "
          f"finish: {', '.join(result.finish_reasons)}, backend {pipe.backend_name}{rank})", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.check:
        if not args.model_dir:
            print("error: --check needs --model_dir (the golden references live in the model folder)", file=sys.stderr)
            return 2
        from lite_runtime.check import main as check_main

        extra = (["--json", args.check_json] if args.check_json else []) + (
            ["--ge_cache_dir", args.ge_cache_dir] if args.ge_cache_dir is not None else []) + (
            ["--rank_table_file", args.rank_table_file] if args.rank_table_file else []) + (
            ["--rank_id", str(args.rank_id)] if args.rank_id else [])
        return check_main([args.model_dir, "--backend", args.backend, "--device_id", str(args.device_id), *extra]
                          + (["-v"] if args.verbose else []))
    try:
        pipe = load(args)
        if args.prompt is not None:
            answer(pipe, args, args.prompt)
            return 0
        while True:
            try:
                text = input("Please enter your predict data:\n")
            except EOFError:
                return 0
            if text.strip() == "exit":
                return 0
            if text.strip():
                answer(pipe, args, text)
    except InferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
