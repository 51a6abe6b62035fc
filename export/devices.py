"""Device profiles: which GE option file and which dtypes each Atlas target (or the CPU) takes."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from export.errors import ExportError

GE_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ge_configs")


GRAPH_FORMS = ("fused", "plain")
# dtypes the fused attention operators take (MindSpore 2.10 op docs: float16, bfloat16, int8); float32 folders are plain
FUSED_DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    hardware: str
    soc: str  # "" for the CPU
    dtypes: Tuple[str, ...]  # dtypes the device has kernels for; the first is the default
    # default prompt-length buckets (default_buckets): first, first*factor, ... below seq_length
    bucket_first: int = 128
    bucket_factor: int = 4
    # whether its SoC runs every fused operator of `--graph fused` (export/network/atlas_layers.py) as we call it:
    # ge_configs/README.md says which SoC runs which and why
    fused: bool = False
    # tokens of the chunk graphs (default_chunks): the smallest goes in with the running rows' decode steps, the
    # largest runs when no row decodes
    chunks: Tuple[int, ...] = (256,)
    # tokens of the score graphs (default_scores): all-positions chunk graphs
    scores: Tuple[int, ...] = (256,)
    # weight-only quantization (--quantize): the bits its WeightQuantBatchMatmul (or, on the CPU, our kernels) takes,
    # and whether per-group scales: A2/A3 int8 and int4, per channel and per group; the 310P series int8 per channel
    # (CANN's aclnnWeightQuantBatchMatmulV2 support table); the Atlas 800 (910A, a training series) has none
    quant_bits: Tuple[int, ...] = ()
    quant_groups: bool = False
    # positions per block of the paged KV cache (--block_size): 128 on Atlas, what vllm-ascend and MindIE use and
    # ReshapeAndCache / PagedAttention recommend (a multiple of 16 for float16/bfloat16); on the CPU by measurement
    # (docs/performance-log.md, "The paged KV cache: block size on the CPU")
    block_size: int = 128

    @property
    def default_dtype(self) -> str:
        return self.dtypes[0]

    @property
    def ini_path(self) -> str:
        return os.path.join(GE_CONFIG_DIR, f"{self.name}.ini")


PROFILES: Dict[str, DeviceProfile] = {
    "atlas_800i_a2": DeviceProfile("atlas_800i_a2", "Atlas 800I A2", "Ascend910B", ("float16", "bfloat16", "float32"),
                                   fused=True, quant_bits=(8, 4), quant_groups=True),
    "atlas_800t_a2": DeviceProfile("atlas_800t_a2", "Atlas 800T A2", "Ascend910B", ("float16", "bfloat16", "float32"),
                                   fused=True, quant_bits=(8, 4), quant_groups=True),
    "atlas_800": DeviceProfile("atlas_800", "Atlas 800", "Ascend910A", ("float16", "float32")),
    # 310P: PromptFlashAttention/IncreFlashAttention take no actual lengths and no GQA there (ge_configs/README.md)
    "atlas_300i_duo": DeviceProfile("atlas_300i_duo", "Atlas 300I Duo", "Ascend310P", ("float16",), quant_bits=(8,)),
    # CPU folders compute in float32; float16 and bfloat16 store the matrices in 16 bits (ExportConfig.compute_dtype)
    "cpu": DeviceProfile("cpu", "CPU", "", ("float32", "bfloat16", "float16"), bucket_first=16, bucket_factor=2,
                         chunks=(8, 128), scores=(8, 128), quant_bits=(8, 4), quant_groups=True, block_size=64),
}
DEFAULT_PROFILE = "atlas_800i_a2"


def get_profile(name: str) -> DeviceProfile:
    """The profile by name; an unknown name fails listing the known ones."""
    try:
        profile = PROFILES[name]
    except KeyError:
        raise ExportError(f"--device {name!r} is not a known profile; known: {', '.join(PROFILES)}") from None
    if not os.path.isfile(profile.ini_path):
        raise ExportError(f"{profile.ini_path}: GE option file of profile {name!r} is missing; "
                          "reinstall from a full checkout (pip install -e .)")
    return profile


def default_buckets(profile: DeviceProfile, seq_length: int) -> Tuple[int, ...]:
    """The prompt-length buckets an export gets without --prefill_buckets (the seq_length graph comes on top).

    The rule: `bucket_first`, times `bucket_factor`, ... while below seq_length.
    - CPU: 16, 32, 64, ... Prefill there is compute-bound, so a prompt's cost is its bucket's length: doubling
      keeps the padding under 2x (a 100-token prompt runs on 128), and a graph costs only seconds to export and
      to compile on first use (the runtime compiles the others when a prompt needs them).
    - Atlas: 128, 512, 2048, ... GE compiles each graph for minutes when the folder loads, and the NPU's
      prefill is cheap next to that, so four times apart keeps the set small (2 extra graphs at 2048).
    """
    sizes = []
    size = profile.bucket_first
    while size < seq_length:
        sizes.append(size)
        size *= profile.bucket_factor
    return tuple(sizes)


def default_chunks(profile: DeviceProfile, seq_length: int, dtype: str) -> Tuple[int, ...]:
    """Tokens of the chunk graphs an export gets without --chunk_sizes: the profile's, at most seq_length.

    A chunk graph runs the decode step of every row and a piece of one row's prompt in one call, so the weights are
    read once for both; what the piece adds is its arithmetic on them. The server puts pieces of the smallest size
    into the running rows' steps, so a step with a piece must cost well under two plain steps (its goal: the running
    streams' gaps stay within twice the steady one while a long prompt goes in); with no row decoding it uses the
    largest, so a long prompt alone is not slowed by small pieces. A step costs the weights' bytes over the memory's
    pace and a piece its tokens' arithmetic, both in proportion to the parameters, so the small size depends on the
    bytes per weight and the machine's balance, not on the model's size:
    - CPU: 8 (float32 weights) or 2 (16-bit weights: a step reads half the bytes, a piece does the same float32
      arithmetic), and 128. Measured on the 0.5B shape (batch 4, 2 cores, AVX-512; docs/performance-log.md,
      "Chunked prefill and prefix reuse", 2026-11-24): float32 step 0.11 s, with a piece of 8 / 12 / 16 tokens
      1.0-1.3x / 1.1-1.6x / 1.2-2.1x of it; bfloat16 step 0.06 s, with a piece of 8 1.8-1.9x, of 16 2.6-3.0x; a
      448-token prompt alone takes 2.9 s in pieces of 128 and 6.5 s in pieces of 16. On a VM of twice that memory
      pace (the same log, "Chunk sizes on a VM with twice the memory pace", 2026-11-25) the steps took 0.052 s
      (float32) and 0.028 s (bfloat16) while a piece's arithmetic cost the same: pieces of 12 and 4 made the gaps
      1.9x and 1.75x (median), their p99 2.2x and 2.3x; hence 8 and 2, with margin for faster memory. Our kernels
      compute a piece's valid tokens only (the chunk graph's q/k/v, attention and tail skip its padding rows, since
      2026-11-30; before, a shorter piece cost as much as a full one), so a piece of 64 through the 128 graph costs
      about half of a full one.
    - Atlas: 256 alone (a multiple of the cube unit's 16): the NPU does some 100 16-bit operations per byte of memory
      it reads, and a step of a 7B reads 14 GB and pays a fixed launch cost besides, so 256 tokens of arithmetic fit
      within about one step; a 2048-token prompt takes 8 pieces. Not measured (no device). One graph, because GE
      compiles each graph for minutes at load.
    """
    sizes = profile.chunks
    if profile.name == "cpu" and dtype != "float32":
        sizes = (2,) + sizes[1:]
    return tuple(sorted({min(c, seq_length) for c in sizes}))


def default_step_rows(profile: DeviceProfile, batch_size: int) -> Tuple[int, ...]:
    """Rows of the extra inc graphs an export gets without --step_rows: on cpu 1, 2, 4, ... below batch_size; on
    Atlas none.

    The inc graph computes every row it was exported with; a step of n live sequences runs the inc graph of the
    fewest rows >= n (lite_runtime/engine/runner.py ModelRunner.step), so one sequence on a batch-16 folder decodes at
    a batch-1 folder's pace (docs/performance-log.md 34). The graphs share the weights file and the KV pool: each
    costs its compile (seconds, on first use) and its file (kilobytes). Powers of two waste at most half the rows a
    step computes. Atlas: none by default, because GE compiles every loaded graph for minutes and the NPU's
    arithmetic makes an idle row nearly free in a memory-bound step (not measured: no device); --step_rows sets them.
    """
    if profile.name != "cpu":
        return ()
    rows, out = 1, []
    while rows < batch_size:
        out.append(rows)
        rows *= 2
    return tuple(out)


def default_scores(profile: DeviceProfile, seq_length: int) -> Tuple[int, ...]:
    """Tokens of the score graphs an export gets without --score_sizes: the profile's, at most seq_length.

    A score graph is a chunk graph that returns the logits of every position of its piece ([1 + C, V]: one step row,
    export/writers/graphs.py SCORE_STEP_ROWS), for speculative decoding (a verify of K draft tokens and the last one: K + 1
    positions), prompt logprobs and perplexity (a prompt in pieces). What the piece adds over a step is its arithmetic, the head's included:
    - CPU: 8 (a verify of up to 7 draft tokens; a piece of 8 costs 1.0-1.3x a float32 step, docs/performance-log.md
      "Chunked prefill and prefix reuse") and 128 (prompts scored in pieces; at 8 a long prompt would pay 16 times
      the weights' reads). Two graphs, because a verify in the 128 graph would pay 128 rows of arithmetic.
    - Atlas: 256 alone, as the chunk graph (default_chunks): a verify's 8 tokens and a 256-token piece both cost
      about one step's reading of the weights there, and GE compiles every graph for minutes at load.
    """
    return tuple(sorted({min(c, seq_length) for c in profile.scores}))


def graph_form(profile: DeviceProfile, dtype: str, asked: Optional[str], head_dim: int, kv_groups: int) -> str:
    """The graph form of an export: `asked` (--graph), or by default `fused` where the profile's SoC runs every
    fused operator used and the model and dtype fit them, else `plain`. An impossible `fused` is an error."""
    if asked not in (None, "auto") + GRAPH_FORMS:
        raise ExportError(f"--graph {asked!r} is not one of auto, {', '.join(GRAPH_FORMS)}")
    why = None
    if not profile.fused and profile.soc.startswith("Ascend310P"):
        why = (f"device profile {profile.name!r} ({profile.soc}): the 310P's PagedAttention and ReshapeAndCache keep the "
               "paged KV cache in the FRACTAL_NZ layout, which this export does not write; its folders take the plain "
               "form (the blocks through Gather and ScatterNdUpdate)")
    elif not profile.fused:
        why = f"device profile {profile.name!r} ({profile.soc or 'CPU'}) has no fused attention operators we can use"
    elif dtype not in FUSED_DTYPES:
        why = f"the fused attention operators take {' or '.join(FUSED_DTYPES)}, not {dtype}"
    elif head_dim % 16 or head_dim > 512:  # CANN PromptFlashAttention: D a multiple of 16 for 16-bit inputs, <= 512
        why = f"the fused attention operators need head_dim a multiple of 16 up to 512, and this model's is {head_dim}"
    elif kv_groups > 64:  # CANN: num_heads / num_key_value_heads <= 64
        why = f"the fused attention operators take at most 64 query heads per kv head, and this model has {kv_groups}"
    if asked in (None, "auto"):
        return "plain" if why else "fused"
    if asked == "fused" and why:
        raise ExportError(f"--graph fused: {why}; export --graph plain")
    return asked


def ascend_present() -> bool:
    """Whether this machine could run an Atlas folder: an Ascend device node, or mindspore_lite installed (looked up,
    not imported: MindSpore and a Lite of another version cannot share a process)."""
    import glob
    import importlib.util

    return bool(glob.glob("/dev/davinci[0-9]*")) or importlib.util.find_spec("mindspore_lite") is not None


def usage_lines(profile: DeviceProfile, dtype: str, compute_dtype: str, graph: str, output: str,
                ascend_here: bool) -> Tuple[str, ...]:
    """What an exported folder is for and how to check or run it (the export's last lines). An Atlas folder exported
    on a machine without Ascend also says what it does here: the CPU runs Ascend's fused operators as stand-ins."""
    import shlex

    folder = shlex.quote(output)
    check = f"python -m lite_runtime.check {folder}"
    if profile.name == "cpu":
        kind = dtype if dtype == compute_dtype else f"{dtype} weights, {compute_dtype} compute"
        return (f"for the CPU ({kind}): {check} checks it, python -m lite_runtime.serve --model_dir {folder} "
                "serves it",)
    first = f"for {profile.hardware} ({dtype}, {graph} graphs): run {check} on the device"
    if ascend_here:
        return (first,)
    if dtype == "bfloat16":
        here = "it cannot run on this CPU (MindSpore has no bfloat16 CPU kernels)"
    elif graph == "fused":
        here = f"on this CPU, {check} runs the fused ops as CPU stand-ins (slow, {dtype})"
    else:
        here = f"on this CPU, {check} runs it with MindSpore's CPU kernels (slow, {dtype})"
    return first, f"no Ascend device here: {here}; or export with --device cpu for a folder to run here"
