"""mslite-llm's own CPU kernels (a C++ library built at `pip install`), used as MindSpore aot Custom ops.

Only `--device cpu` folders use them: matmuls (GEMV for a few rows, a blocked GEMM for more) and the
embedding lookup, with float32, float16 or bfloat16 weights widened to float32 (see matmul16.cc for why), and matmuls
of int8/int4 weights (matmul_quant.cc: up to 16 rows, x rounded to int16 per block of 32 and integer products; beyond,
dequantized per tile). The fused decode ops take each weight as one float tensor or as a quantized one's q, scale[,
offset]. common.h says which C++ file holds which kernels.
A graph stores the library as a bare file name (`LIBRARY_FILE:<function>`); MindSpore needs a
path that exists, so the `ms` backend rewrites it to this machine's copy when it loads the graph.
Importable without MindSpore.
"""
from __future__ import annotations

import ctypes
import glob
import os
from typing import Optional

LIBRARY_FILE = "mslite_llm_cpu_kernels.so"  # the name graphs carry
GEMV = "MsliteLlmGemv"  # x [M, I] float32 . W[O, I]^T -> [M, O] float32; W float32, float16 or bfloat16; any M
GEMV_BIAS = "MsliteLlmGemvBias"  # the same plus b [O] float32
GEMM_VALID = "MsliteLlmGemmValid"  # x [B*n, I], W [O, I], (b [O],) valid_length [B] int32 -> [B*n, O]: each row's
#   first valid_length tokens computed, the padding rows zero (the full graph: cost follows the prompt, not the graph)
EMBED = "MsliteLlmEmbed"  # ids [N] int32/int64, table [V, E] float32/float16/bfloat16 -> [N, E] float32
EMBED_QUANT = "MsliteLlmEmbedQuant"  # ids [N], q [V, E] int8 or [V, E / 2] uint8 (int4), scale [G, V] float32
#   (, offset [G, V] float32) -> [N, E] float32 = (q + offset) * scale: a quantized table's lookup in one call
# the decode step's fused ops (float32 activations): one call for what MindSpore runs as a chain of small kernels
RMS_NORM = "MsliteLlmRmsNorm"  # x [N, E], w [E], eps [1] -> [N, E]
QKV_ROPE = "MsliteLlmQkvRope"  # x, Wq, bq, Wk, bk, Wv, bv, cos [N, D], sin [N, D] [, q_norm, k_norm [D], eps [1]]
#   -> q, k, v (RoPE on q and k, after the per-head RMSNorm when the norms are given: Qwen3)
GEMV_ADD = "MsliteLlmGemvAdd"  # x [N, I], W [O, I], r [N, O] -> x.W^T + r (a projection and the residual add)
SWIGLU = "MsliteLlmSwiGlu"  # x [N, I], Wg, Wu [O, I] -> silu(x.Wg^T) * (x.Wu^T) [N, O]
# the paged KV cache (cpu_kernels/paged.h): key_cache, value_cache [NB, KH, BS, D] float32 or bfloat16 (KV16_OPS); a
#   token's slot is block * BS + its position in the block (negative: not written); a block table lists a sequence's
#   blocks in order
DECODE_ATTENTION = "MsliteLlmPagedAttention"  # q [N, H*D], K, V caches, lengths [N], rows [N], tables [R, M] int32 ->
#   [N, H*D]: query i attends to the first lengths[i] positions of the sequence whose block table is tables[rows[i]]
DECODE_QKV = "MsliteLlmPagedDecodeQkv"  # x, ln_w, eps, Wq, bq, Wk, bk, Wv, bv, cos, sin [N, D], key_cache, value_cache,
#   slot_mapping [N] int32 [, q_norm, k_norm] -> q [N, H*D]: the input norm, q/k/v, RoPE, and k, v written into the
#   caches at each token's slot, in place
WRITE_CACHE = "MsliteLlmWriteCache"  # k, v [N, KH*D], key_cache, value_cache, slot_mapping [N] int32 -> [1] (0): k, v
#   written at each token's slot, in place (the chunk graph's writes)
NORM_SWIGLU = "MsliteLlmNormSwiGlu"  # h [B, E], ln_w [E], eps [1], Wg, Wu [O, E] -> SwiGLU of RMSNorm(h) [B, O]
DECODE_TAIL = "MsliteLlmDecodeTail"  # attn [N, A], Wo [E, A], x [N, E], ln_w [E], eps [1], Wg, Wu [I, E], Wd [E, I]
#   -> h + down(SwiGLU(RMSNorm(h))) with h = x + attn . Wo^T [N, E]: the layer after the attention (no o/MLP biases)
DECODE_LAYER = "MsliteLlmPagedDecodeLayer"  # layout int32 [3] (nq, nt, kc), DECODE_QKV's nq inputs, lengths [N],
#   rows [N], tables [R, M], DECODE_TAIL's nt inputs after attn -> [N, E]: a decode step's layer in one call (the three
#   ops in turn; kc: key_cache's index among DECODE_QKV's inputs)
# the chunk graph's DECODE_LAYER, and its QKV_ROPE where a layer takes several calls: valid int32 [1] (its step rows
#   plus the piece's valid tokens) before the op's own tensors; rows past it are neither computed nor written, and
#   come out zero (its piece's padding)
DECODE_LAYER_VALID = "MsliteLlmPagedDecodeLayerValid"
QKV_ROPE_VALID = "MsliteLlmQkvRopeValid"
# weight-only quantized matmuls (matmul_quant.cc): W [N, K] as q int8 [N, K] or int4 (uint8 [N, K/2], low nibble first) with
#   scale (and offset) [G, N] per group of K/G inputs, W = (q + offset) * scale
QUANT_MATMUL = "MsliteLlmQuantMatmul"  # x [M, K] float32, q, scale [G, N] float32 -> x . W^T [M, N] float32; any M
QUANT_MATMUL_OFFSET = "MsliteLlmQuantMatmulOffset"  # the same with offset [G, N] float32 after scale
QUANT_MATMUL_VALID = "MsliteLlmQuantMatmulValid"  # x, q, scale, valid_length [B] int32 -> y: the full graph's form,
#   x holding B rows of n tokens, only each row's first valid_length computed, the padding rows zero (as GEMM_VALID)
QUANT_MATMUL_OFFSET_VALID = "MsliteLlmQuantMatmulOffsetValid"  # the same with offset
MOE = "MsliteLlmMoe"  # layout int32 [3] (k, norm_topk_prob, residual), x [N, H] (residual: h, ln_w [H], eps [1]),
#   router [E, H], gate_up [E, 2I, H], down [E, H, I] (each one float tensor or q, scale [E, G, n][, offset]) -> [N, H]:
#   the router, a float32 softmax and top k, each row's chosen experts' SwiGLU weighted and summed (residual: h +
#   that of RMSNorm(h)); the experts no row chose are not read (cpu_kernels/moe.cc)
DECODE_MOE_LAYER = "MsliteLlmPagedDecodeMoeLayer"  # layout int32 [4] (nq, no, kc, nm), DECODE_QKV's nq inputs,
#   lengths [N], rows [N], tables [R, M], Wo's no tensors, MOE's nm inputs but h (its layout first) -> [N, E]: a
#   mixture of experts' decode step layer in one call (decode_qkv, the attention, o_proj + x, MOE's residual form)
ATLAS_WEIGHT_QUANT_BATCH_MATMUL = "MsliteLlmAtlasWeightQuantBatchMatmul"  # WeightQuantBatchMatmul's CPU stand-in:
#   x [M, K] T, q [N, ...], scale [G, N] T[, offset [G, N] T], attrs [antiquant_group_size] -> [M, N] T (W rounded to T)
# the fused ops under the names a quantized folder's graphs call: the same ops (each weight one float tensor or q,
# scale[, offset]); the names make an installation whose ops read float weights only refuse such a folder at load
QUANTIZED_OPS = {QKV_ROPE: "MsliteLlmQuantQkvRope", GEMV_ADD: "MsliteLlmQuantGemvAdd",
                 DECODE_QKV: "MsliteLlmQuantPagedDecodeQkv", NORM_SWIGLU: "MsliteLlmQuantNormSwiGlu",
                 DECODE_TAIL: "MsliteLlmQuantDecodeTail", DECODE_LAYER: "MsliteLlmQuantPagedDecodeLayer",
                 QKV_ROPE_VALID: "MsliteLlmQuantQkvRopeValid", DECODE_LAYER_VALID: "MsliteLlmQuantPagedDecodeLayerValid"}
# The ops that read or write the paged cache, under the names a graph with bfloat16 caches calls (paged.h: a folder of
# a bfloat16 dtype keeps its KV cache in bfloat16, export/config.py kv_dtype), their quantized names' too: the same
# ops; the names make an installation whose kernels read float32 caches only refuse such a folder at load
KV16_OPS = {f: f + "Kv16" for f in (DECODE_ATTENTION, DECODE_QKV, WRITE_CACHE, DECODE_LAYER, DECODE_LAYER_VALID,
                                    DECODE_MOE_LAYER, QUANTIZED_OPS[DECODE_QKV], QUANTIZED_OPS[DECODE_LAYER],
                                    QUANTIZED_OPS[DECODE_LAYER_VALID])}
# The ops that read quantized weights, under a second name for weights in bands of 16 rows (matmul_quant.h
# repack_int4_r16, repack_int8_r16): the runtime renames an op so at load after repacking every quantized weight it
# reads (_repacked_weights in lite_runtime/backends/ms.py; docs/architecture.md, "int4 in bands of 16 rows"). Never
# written in a folder.
R16_OPS = {f: f + "R16" for f in (QUANT_MATMUL, QUANT_MATMUL_OFFSET, QUANT_MATMUL_VALID, QUANT_MATMUL_OFFSET_VALID,
                                  *QUANTIZED_OPS.values(), MOE, DECODE_MOE_LAYER,
                                  *(KV16_OPS[f] for f in (QUANTIZED_OPS[DECODE_QKV], QUANTIZED_OPS[DECODE_LAYER],
                                                          QUANTIZED_OPS[DECODE_LAYER_VALID], DECODE_MOE_LAYER)))}
# The ops that read a few rows of their table a call (a lookup): what only they read is not copied into huge pages at
# load (lite_runtime/backends/ms.py _kernel_weights: a step touches a few of its pages; an untied embedding)
ROW_READERS = (EMBED, EMBED_QUANT)
# One of our ops called with its weights as places in one arena (registry.cc; lite_runtime/backends/arena.py): written
# by the runtime at load, never in a folder, so not among FUNCTIONS (a folder calling it is refused at load)
ARENA_CALL = "MsliteLlmArenaCall"
FUNCTIONS = (GEMV, GEMV_BIAS, GEMM_VALID, EMBED, EMBED_QUANT, RMS_NORM, QKV_ROPE, GEMV_ADD, SWIGLU, DECODE_ATTENTION, DECODE_QKV,
             WRITE_CACHE, NORM_SWIGLU, DECODE_TAIL, QKV_ROPE_VALID, DECODE_LAYER_VALID, DECODE_LAYER, QUANT_MATMUL, QUANT_MATMUL_OFFSET, QUANT_MATMUL_VALID, QUANT_MATMUL_OFFSET_VALID,
             ATLAS_WEIGHT_QUANT_BATCH_MATMUL, MOE, DECODE_MOE_LAYER,
             *QUANTIZED_OPS.values(), *R16_OPS.values(), *KV16_OPS.values())


def fused_op(function: str, quantized: bool, kv16: bool = False) -> str:
    """The name a graph calls fused op `function` by: QUANTIZED_OPS' where its weights are quantized, then KV16_OPS'
    where its KV cache is bfloat16."""
    name = QUANTIZED_OPS.get(function, function) if quantized else function
    return KV16_OPS.get(name, name) if kv16 else name

BUILD_HINT = "reinstall with a C++ compiler present (apt install g++; pip install -e .)"

_HERE = os.path.dirname(os.path.abspath(__file__))
_loaded: Optional[ctypes.CDLL] = None


def library_path() -> Optional[str]:
    """This installation's built library, or None when it was not built (no compiler at install)."""
    found = sorted(glob.glob(os.path.join(_HERE, "_mslite_llm_cpu_kernels*.so")))
    return found[0] if found else None


def graph_func(function: str) -> str:
    """The `func` a graph stores: the bare library name, relocated at load by `local_func`."""
    return f"{LIBRARY_FILE}:{function}"


def names_our_library(func: str) -> bool:
    """Whether a Custom op's func string points at our kernel library (as exported, or built anywhere), whatever
    function it names: a graph exported by another version may call one this installation does not know."""
    name = os.path.basename(func.rpartition(":")[0])
    return name == LIBRARY_FILE or name.startswith("_mslite_llm_cpu_kernels")


def is_ours(func: str) -> bool:
    """Whether a Custom op's func string names one of our kernels (as exported, or built anywhere)."""
    return func.rpartition(":")[2] in FUNCTIONS and names_our_library(func)


def unknown_functions(model) -> list:
    """The functions of our library that a parsed MindIR ModelProto calls and this installation's library lacks
    (not among FUNCTIONS, or not in the built library: a folder exported by a newer mslite-llm), sorted."""
    lib = _library()
    missing = set()
    for prim in model.primitives:
        for attr in prim.attribute:
            if attr.name != "func_name":
                continue
            func = attr.s.decode("utf-8", "replace")
            function = func.rpartition(":")[2]
            if names_our_library(func) and (function not in FUNCTIONS or (lib is not None
                                                                          and not hasattr(lib, function))):
                missing.add(function)
    return sorted(missing)


def local_func(func: str) -> str:
    """`func` pointed at this machine's library. Raises FileNotFoundError when it was not built."""
    path = library_path()
    if path is None:
        raise FileNotFoundError(f"the mslite-llm CPU kernel library is not built in {_HERE}; {BUILD_HINT}")
    return f"{path}:{func.rpartition(':')[2]}"


def retarget(model, target) -> int:
    """In a parsed MindIR ModelProto, replace each of our kernels' func strings f by target(f); returns how many.

    MindSpore stores the func twice per Custom primitive: `func_name` and `uniq_name` ("Custom__" + func).
    """
    count = 0
    for prim in model.primitives:
        for attr in prim.attribute:
            text = attr.s.decode("utf-8", "replace") if attr.s else ""
            prefix = "Custom__" if text.startswith("Custom__") else ""
            if is_ours(text[len(prefix):]):
                attr.s = (prefix + target(text[len(prefix):])).encode()
                count += 1
    return count


def _library():
    global _loaded
    if _loaded is None:
        path = library_path()
        if path is None:
            return None
        _loaded = ctypes.CDLL(path)
    return _loaded


def has_function(function: str) -> bool:
    """Whether this installation's built library exports `function` (False where it was not built)."""
    lib = _library()
    return lib is not None and hasattr(lib, function)


def function_address(function: str) -> int:
    """The address of `function` in this installation's library as this process loaded it (the one MindSpore's
    Custom ops call: the same file, so the same loaded copy): what an arena call's table holds
    (lite_runtime/backends/arena.py). Raises AttributeError for a function the library lacks."""
    lib = _library()
    if lib is None:
        raise FileNotFoundError(f"the mslite-llm CPU kernel library is not built in {_HERE}; {BUILD_HINT}")
    return int(ctypes.cast(getattr(lib, function), ctypes.c_void_p).value)


def set_threads(threads: int) -> None:
    """Threads the kernels use, all of them (one pool: pool.cc; the runtime passes its CPU thread count). Loads the
    library."""
    lib = _library()
    if lib is not None:
        lib.MsliteLlmSetThreads(ctypes.c_int(int(threads)))


QUANT_ACTIVATIONS = ("int8", "exact", "int16")  # cpu_kernels/matmul_quant.h Activations, in its order


def set_quant_activations(mode: Optional[str]) -> Optional[str]:
    """How the quantized matmuls' decode form rounds x, process-wide (cpu_kernels/matmul_quant.h): "int8" (the default,
    the fast path: x to int8 per block of 32 for int4 weights whose K is a multiple of 64 and group 32 or a multiple of
    64, to int16 per block of 32 for the others), "int16" (x to int16 for every weight: the rounding a folder exported
    before the int8 form was checked in), "exact" (two int16 parts: float32's arithmetic; what check holds to the
    reference's own rounding; it also holds bfloat16 weights to float32's form, bf16_form), None: the default again
    (MSLITE_LLM_QUANT_ACTIVATIONS, else int8). Returns the mode in force, or None when the library was not built."""
    lib = _library()
    if lib is None:
        return None
    if mode is not None and mode not in QUANT_ACTIVATIONS:
        raise ValueError(f"quantized activations {mode!r} is not one of {', '.join(QUANT_ACTIVATIONS)}")
    code = -1 if mode is None else QUANT_ACTIVATIONS.index(mode)
    return QUANT_ACTIVATIONS[lib.MsliteLlmSetQuantActivations(ctypes.c_int(code))]


def quant_activations() -> Optional[str]:
    """The mode set_quant_activations last set (or the default), None when the library was not built."""
    lib = _library()
    return None if lib is None else QUANT_ACTIVATIONS[lib.MsliteLlmSetQuantActivations(ctypes.c_int(-2))]


def quant_form() -> Optional[str]:
    """The quantized matmuls' decode form on this machine: "avx512_vnni" (the AVX-512 path on a CPU with VNNI), "avx2"
    (AVX2, and AVX-512 without VNNI), "neon" or "generic"; None when the library was not built."""
    lib = _library()
    if lib is None:
        return None
    lib.MsliteLlmQuantForm.restype = ctypes.c_char_p
    return lib.MsliteLlmQuantForm().decode()


def tiles() -> Optional[str]:
    """Whether AMX tiles multiply on this machine: "amx" (a CPU with AMX whose kernel grants the process the tile
    state: banded int8 weights from 2 rows of x and banded int4 ones from 8, tdpbsud, the same results as the vector
    form bit for bit; bfloat16 weights from BF16_MIN_ROWS rows, tdpbf16ps, x rounded to bfloat16 as the AVX512-BF16
    form rounds it; the prompt's rows too) or "none"; None when the library was not built.
    MSLITE_LLM_CPU_KERNELS_AMX=0 (read at load) holds it to "none"; set_tiles switches it."""
    lib = _library()
    return None if lib is None else ("amx" if lib.MsliteLlmSetTiles(ctypes.c_int(-1)) else "none")


def paths() -> Optional[str]:
    """Every form this machine's kernels run, in one line for a benchmark's record: "avx512, quantized decode
    avx512_vnni, bfloat16 rows avx512_bf16, AMX tiles amx" (isa, quant_form, bf16_form, tiles); None when the library
    was not built."""
    if _library() is None:
        return None
    return f"{isa()}, quantized decode {quant_form()}, bfloat16 rows {bf16_form()}, AMX tiles {tiles()}"


def set_tiles(on: bool) -> Optional[str]:
    """AMX tiles on (where this machine has them) or off, process-wide, for tests and benchmarks: returns tiles()
    after the switch."""
    lib = _library()
    if lib is None:
        return None
    return "amx" if lib.MsliteLlmSetTiles(ctypes.c_int(1 if on else 0)) else "none"


def int4_r16_runs(k: int, group: int) -> bool:
    """Whether int4 weights of k inputs in groups of `group` take the banded form (int4 in bands of 16 rows, the AVX-512
    VNNI and the AVX2 forms with x in int8) on this machine in the default activations mode (what serves, whatever mode
    check has switched to for a replay): what the runtime repacks for."""
    lib = _library()
    return lib is not None and bool(lib.MsliteLlmInt4R16Runs(ctypes.c_int64(int(k)), ctypes.c_int64(int(group))))


def repack_int4_r16(q) -> None:
    """int4 weights q (numpy uint8 [N, K / 2], or a mixture of experts' stack [E, N, K / 2]: each expert's matrix
    alone; C-contiguous and writable) repacked in place into bands of 16 rows (matmul_quant.h repack_int4_r16), what
    the R16 ops read. Raises ValueError for an array it cannot take."""
    _repack_bands(q, "uint8", 4)


def int8_r16_runs(k: int, group: int) -> bool:
    """Whether int8 weights of k inputs in groups of `group` take the banded form (int8 in bands of 16 rows, biased,
    against x in int8: the AVX-512 VNNI form, K a multiple of 64, the group too or 32) on this machine in the default
    activations mode: what the runtime repacks for (elsewhere a banded int8 weight would only be read through the
    float32 form)."""
    lib = _library()
    return lib is not None and bool(lib.MsliteLlmInt8R16Runs(ctypes.c_int64(int(k)), ctypes.c_int64(int(group))))


def bands_here(bits: int) -> bool:
    """Whether the runtime repacks int{bits} weights into bands on this machine at all: the form exists here (K 64 in
    groups of 64 fits both forms' rules, so false only where the CPU or the default mode has none) and
    MSLITE_LLM_INT{bits}_BANDS is not 0 (the row-major forms kept: an A/B, or a suspicion). Which weights are banded is
    lite_runtime/backends/ms.py _repacked_weights'; `--speculative auto` reads this too (lite_runtime/serve/cli.py)."""
    if os.environ.get(f"MSLITE_LLM_INT{bits}_BANDS") == "0":
        return False
    return int4_r16_runs(64, 64) if bits == 4 else int8_r16_runs(64, 64)


def repack_int8_r16(q) -> None:
    """int8 weights q (numpy int8 [N, K], or a mixture of experts' stack [E, N, K]: each expert's matrix alone;
    C-contiguous and writable) biased and repacked in place into bands of 16 rows (matmul_quant.h repack_int8_r16),
    what the R16 ops read. Raises ValueError for an array it cannot take."""
    _repack_bands(q, "int8", 8)


def _repack_bands(q, dtype: str, bits: int) -> None:
    """repack_int4_r16 / repack_int8_r16: each matrix of q (`dtype`, [N, K * bits / 8] or [E, ...]) through the
    library's MsliteLlmRepackInt{bits}R16."""
    lib = _library()
    if lib is None:
        raise FileNotFoundError(f"the mslite-llm CPU kernel library is not built in {_HERE}; {BUILD_HINT}")
    shape = "[N, K / 2] or [E, N, K / 2]" if bits == 4 else "[N, K] or [E, N, K]"
    if str(q.dtype) != dtype or q.ndim not in (2, 3) or not q.flags.c_contiguous or not q.flags.writeable:
        raise ValueError(f"int{bits} weights to repack must be a writable C-contiguous {dtype} {shape} array, not "
                         f"{q.dtype} {q.shape}")
    inputs = q.shape[-1] * 8 // bits
    repack = getattr(lib, f"MsliteLlmRepackInt{bits}R16")
    for matrix in (q,) if q.ndim == 2 else q:
        if repack(ctypes.c_void_p(matrix.ctypes.data), ctypes.c_int64(matrix.shape[0]), ctypes.c_int64(inputs)):
            raise ValueError(f"int{bits} weights of {inputs} inputs are not whole blocks of 32: not repacked")


# cpu_kernels/matmul16.h: the rows of x for which bfloat16 weights take the AVX512-BF16 form (its rows form; from
# BF16_GEMM_ROWS rows, a width in whole blocks of 32 takes its GEMM, with no upper bound)
BF16_MIN_ROWS, BF16_MAX_ROWS, BF16_GEMM_ROWS = 5, 64, 17


def bf16_form() -> Optional[str]:
    """The form of the bfloat16 weights' matmul from BF16_MIN_ROWS rows of x on this machine (to BF16_MAX_ROWS, or
    any count of a width in whole blocks of 32): "avx512_bf16" (x rounded to bfloat16, vdpbf16ps: the AVX-512 path on
    a CPU with AVX512_BF16) or "float32" (widened weights, float32 FMA); None when the library was not built.
    set_quant_activations("exact") holds it to float32's form."""
    lib = _library()
    if lib is None:
        return None
    lib.MsliteLlmBf16Form.restype = ctypes.c_char_p
    return lib.MsliteLlmBf16Form().decode()


def isa() -> Optional[str]:
    """The code path the kernels run on this machine ("avx512", "avx2", "neon" or "generic": chosen when the library
    loads, from the CPU and MSLITE_LLM_CPU_KERNELS_ISA), or None when the library was not built."""
    lib = _library()
    if lib is None:
        return None
    lib.MsliteLlmIsa.restype = ctypes.c_char_p
    return lib.MsliteLlmIsa().decode()
