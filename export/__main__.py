"""CLI: python -m export --checkpoint <hf_dir> --output <model_dir> [...]; see --help."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import List, Optional, Tuple

from export.devices import DEFAULT_PROFILE, PROFILES, ascend_present
from export.errors import ExportError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m export",
        description="Export a Hugging Face Qwen2/Qwen2.5, Qwen3 or Llama checkpoint (or a Qwen3-MoE or Qwen2-MoE "
                    "mixture of experts, qwen3_moe or qwen2_moe) as a model folder: prefill, "
                    "incremental and chunk MindIR graphs sharing one weights file and a KV cache, the GE config.ini "
                    "of the target device, the tokenizer, golden references, one yaml and a manifest with checksums.")
    p.add_argument("--checkpoint", required=True,
                   help="HF model folder (config.json, *.safetensors, tokenizer files), or a .gguf file of a llama, "
                        "qwen2, qwen3, qwen3moe or qwen2moe model (config, tokenizer and chat template from its "
                        "metadata; its tensors dequantized to --dtype)")
    p.add_argument("--output", required=True, help="model folder to write (refused if it exists, see --overwrite)")
    p.add_argument("--name", default=None, help="file name stem inside the folder (default: the folder's name)")
    p.add_argument("--seq_length", type=int, default=1024,
                   help="tokens per row the graphs hold, prompt plus generated (default: 1024)")
    p.add_argument("--batch_size", type=int, default=1, help="rows per call, fixed in the graphs (default: 1)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="weights and compute dtype (default: float16 on Atlas; on cpu the checkpoint's own when it is "
                        "bfloat16 or float16, else float32); on cpu, float16/bfloat16 store the weights in 16 bits and "
                        "compute in float32")
    p.add_argument("--device", default=DEFAULT_PROFILE,
                   help=f"device profile: {', '.join(PROFILES)} (default: {DEFAULT_PROFILE}); "
                        "picks ge_configs/<device>.ini and the dtypes allowed")
    p.add_argument("--prefill_buckets", default="auto",
                   help="shorter prompt lengths to export full graphs for as well, comma-separated, e.g. 128,512: "
                        "a prompt runs on the smallest that fits, so prefill cost follows the prompt. All graphs "
                        "share one weights file and the KV cache. auto (default): on cpu 16, 32, 64, ... and on "
                        "Atlas 128, 512, 2048, ... below --seq_length; none: only the --seq_length graph")
    p.add_argument("--chunk_sizes", default="auto",
                   help="tokens of the chunk graphs, comma-separated; each runs the decode step of every row and a "
                        "piece of one row's prompt in one call: the server (python -m lite_runtime.serve) prefills "
                        "each prompt piece by piece inside the running requests' decode steps (pieces of the smallest "
                        "size; the largest when nothing else runs), after the prefix the KV blocks it shares "
                        "with earlier requests (prefix caching). auto (default): 8,128 on cpu (2,128 for 16-bit weights), 256 on Atlas (GE "
                        "compiles each graph for "
                        "minutes), at most --seq_length; none: no chunk graph (a folder the server refuses)")
    p.add_argument("--score_sizes", default="auto",
                   help="tokens of the score graphs, comma-separated: chunk graphs that return the logits of every "
                        "position of their piece, for speculative decoding (a verify of up to size - 1 draft "
                        "tokens), prompt logprobs (echo) and python -m lite_runtime.perplexity. auto (default): 8,128 "
                        "on cpu, 256 on Atlas, at most --seq_length; none: no score graph")
    p.add_argument("--step_rows", default="auto",
                   help="rows of extra inc graphs, comma-separated, each fewer than --batch_size: a decode step of n "
                        "sequences runs the inc graph of the fewest rows that hold them, so its kernels compute only "
                        "those (one sequence on a batch-16 folder decodes at a batch-1 folder's pace). auto "
                        "(default): 1, 2, 4, ... below --batch_size on cpu, none on Atlas (GE compiles each graph "
                        "for minutes); none: only the --batch_size inc graph")
    p.add_argument("--cpu_kernels", choices=("auto", "on", "off"), default="auto",
                   help="--device cpu, float32: run the decode step's matmuls with mslite-llm's own multi-threaded "
                        "GEMV kernel (built at pip install) instead of MindSpore's MatMul: about 1.2x the decode "
                        "speed of MatMul on a 2-core machine. auto: when the kernel library is built (default); "
                        "off: plain MindSpore graphs")
    p.add_argument("--tp_size", type=int, default=1,
                   help="tensor parallel ranks: the folder holds each rank's graphs and weights (heads and MLP columns "
                        "split Megatron style, AllReduce after o_proj and down_proj); run it under msrun (CPU) or one "
                        "Lite process per card (Atlas). Must divide the heads, kv heads and intermediate size "
                        "(default: 1)")
    p.add_argument("--graph", choices=("auto", "fused", "plain"), default="auto",
                   help="Atlas graph form: fused runs Ascend's fused attention (PromptFlashAttention for "
                        "prompts, ReshapeAndCache and PagedAttention for the paged cache), RmsNorm and rotary operators with the lengths as tensors; plain only "
                        "ops MindSpore's CPU also has. auto (default): fused where the profile's SoC has the "
                        "operators and the dtype is float16/bfloat16, else plain (ge_configs/README.md)")
    p.add_argument("--quantize", choices=("none", "int8", "int4"), default=None,
                   help="store the linear layers' weights in 8 or 4 bits (W8A16 / W4A16: Ascend's "
                        "WeightQuantBatchMatmul on Atlas, mslite-llm's kernels on cpu), round-to-nearest. Default: a "
                        "GPTQ, AWQ or Q8_0/Q4_0/Q4_1 GGUF checkpoint keeps its own quantization as it is, a float one "
                        "stays float; none: float weights")
    p.add_argument("--quantize_tables", choices=("auto", "none", "int8"), default="auto",
                   help="the embedding and the head of a quantized folder. auto (default): with --quantize, int8 per "
                        "row (an untied embedding int4 in an int4 folder); of a GPTQ, AWQ or GGUF checkpoint, as it "
                        "holds them (float tables in --dtype, a GGUF's Q8_0/Q4_0/Q4_1 tables kept, other types widened "
                        "to --dtype). none: float tables. int8: int8 per row, also for an imported checkpoint's "
                        "(quantized a second time: recorded in the manifest; refused for a table held in fewer than 8 "
                        "bits)")
    p.add_argument("--group_size", type=int, default=None,
                   help="inputs per scale with --quantize: 0 is per channel; default 0 for int8, 128 for int4 (or the "
                        "largest power of two, at least 32, that divides every layer's input size)")
    p.add_argument("--block_size", type=int, default=None,
                   help="positions per block of the paged KV cache, which every graph writes and reads through block "
                        "tables (the pool's size is set when the folder is loaded). Default: 128 on Atlas (vllm-ascend's "
                        "and MindIE's; a multiple of 16 up to 512 there), 64 on cpu (measured: docs/performance.md)")
    p.add_argument("--kv_cache_dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="the KV cache's dtype on cpu folders. auto: bfloat16 where the weights are bfloat16 (a "
                        "bfloat16 checkpoint's default; the attention reads half the bytes, a pool holds twice the "
                        "tokens, and HF runs such a model with a bfloat16 cache too), int8/int4 folders of a bfloat16 "
                        "--dtype too; else float32. On Atlas the cache is the compute dtype")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.add_argument("-v", "--verbose", action="store_true", help="log each stage as it starts, and more")
    return p


def parse_sizes(text: str, option: str) -> Optional[Tuple[int, ...]]:
    """None for auto (the device's rule), () for none, else the sizes."""
    if text.strip().lower() == "auto":
        return None
    if text.strip().lower() in ("none", ""):
        return ()
    try:
        return tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        raise ExportError(f"{option} {text!r} must be auto, none or comma-separated integers, e.g. 128,512") from None


def default_dtype(profile, checkpoint: str) -> str:
    """--dtype when not given: the profile's (float16 on Atlas), but on `cpu` the checkpoint's own dtype when it is
    bfloat16 or float16 (as Qwen releases are): its weights kept bit for bit in 16 bits, half the folder and memory,
    decoded faster than float32 (docs/performance.md, "The CPU path against HF transformers and llama.cpp"),
    computing in float32. Needs the CPU kernels."""
    if profile is None:
        return "float32"
    if profile.name != "cpu":
        return profile.default_dtype
    from export.checkpoints.gguf import gguf_config, is_gguf
    from export.checkpoints.gguf_file import open_gguf_file

    try:
        if is_gguf(checkpoint):
            doc = gguf_config(open_gguf_file(checkpoint), checkpoint)
        else:
            with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as fh:
                doc = json.load(fh)
    except (OSError, ValueError, ExportError):
        return profile.default_dtype  # run_export reports the checkpoint's problem
    stored = doc.get("torch_dtype") or doc.get("dtype")
    import cpu_kernels

    if stored in ("bfloat16", "float16") and cpu_kernels.library_path() is not None:
        return stored
    return profile.default_dtype


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from export.config import ExportConfig
    from export.pipeline import run_export

    try:
        profile = PROFILES.get(args.device)  # an unknown name is reported by run_export
        dtype = args.dtype or default_dtype(profile, args.checkpoint)
        name = args.name or os.path.basename(os.path.normpath(args.output))
        cfg = ExportConfig(checkpoint=args.checkpoint, output=args.output, name=name, seq_length=args.seq_length,
                           batch_size=args.batch_size, dtype=dtype, device=args.device, overwrite=args.overwrite,
                           prefill_buckets=parse_sizes(args.prefill_buckets, "--prefill_buckets"), cpu_kernels=args.cpu_kernels,
                           tp_size=args.tp_size, graph=None if args.graph == "auto" else args.graph,
                           chunk_sizes=parse_sizes(args.chunk_sizes, "--chunk_sizes"),
                           score_sizes=parse_sizes(args.score_sizes, "--score_sizes"),
                           step_rows=parse_sizes(args.step_rows, "--step_rows"), quantize=args.quantize,
                           group_size=args.group_size, quantize_tables=args.quantize_tables,
                           block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype)
        # the bars are drawn on a terminal only; piped, each stage is one plain line instead (-v logs them already)
        plain = not args.quiet and not args.verbose and not sys.stderr.isatty()
        summary = run_export(cfg, show_progress=not args.quiet,
                             on_stage=(lambda text: print(text, file=sys.stderr, flush=True)) if plain else None)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    print(summary.line())
    print(summary.stage_line())
    for line in summary.quantization_lines() or summary.limits_lines():  # a quantized folder's include its limits
        print(line)
    for line in summary.usage_lines(ascend_present()):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
