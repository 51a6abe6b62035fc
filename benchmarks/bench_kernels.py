"""Times cpu_kernels' matmul (y = x . W^T) against MindSpore's MatMul and torch on the Qwen2-0.5B matrices.

    python benchmarks/bench_kernels.py                     # M = 1, 16, 100, 512; lm_head at M = 1, 16
    python benchmarks/bench_kernels.py --rows 1,2,4,8 --shapes 4864x896 --engines ours

Engines: ours with float32 / float16 / bfloat16 weights (the library called directly through ctypes,
as MindSpore's aot Custom op calls it), MindSpore `ops.MatMul(transpose_b=True)` in graph mode and
torch `nn.functional.linear`, both float32. Every engine uses --threads threads. x is float32 [M, I],
W is [O, I]. Each cell is the best of --repeat runs, a run being the mean over enough calls to last
about --seconds / --repeat: on a shared VM single figures move by +-20 %, ratios within one run count.
Prints a markdown table: ms and GFLOP/s per cell (GB/s of weights read at M = 1), then ours (f32)
over MindSpore and over torch (> 1: ours is faster). By default each engine cycles through copies of W
that together exceed the L3 cache, as a model step does (--warm: one copy); MindSpore runs its copies
as one graph of several MatMuls (time divided by the copies): switching graphs costs it ~0.1 s.
Not a test: nothing here runs in the test suite.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import cpu_kernels  # noqa: E402

# name, O, I: the 0.5B model's matmuls (q/k/v fused is 896 + 2 * 128 = 1152 outputs)
SHAPES = {"4864x896": ("gate/up", 4864, 896), "896x4864": ("down", 896, 4864), "1152x896": ("qkv", 1152, 896),
          "896x896": ("o_proj", 896, 896), "151936x896": ("lm_head", 151936, 896)}
DEFAULT_SHAPES = "4864x896,896x4864,1152x896,151936x896"
BIG_ROWS = 16  # lm_head only up to this many rows: one call at M=512 takes seconds
ENGINES = ("ours_f32", "ours_f16", "ours_bf16", "ms", "torch")


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


class Ours:
    """One prepared call of MsliteLlmGemv: ctypes argument arrays built once."""

    def __init__(self, lib, x: np.ndarray, w: np.ndarray, w_dtype: str):
        self.y = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)  # pages touched: no faults in the timing
        arrays = (x, w, self.y)
        self._keep = arrays
        self.params = (ctypes.c_void_p * 3)(*[a.ctypes.data for a in arrays])
        self.ndims = (ctypes.c_int * 3)(2, 2, 2)
        self._rows = [(ctypes.c_int64 * 2)(*a.shape) for a in arrays]
        self.shapes = (ctypes.POINTER(ctypes.c_int64) * 3)(
            *[ctypes.cast(r, ctypes.POINTER(ctypes.c_int64)) for r in self._rows])
        self.dtypes = (ctypes.c_char_p * 3)(b"float32", w_dtype.encode(), b"float32")
        self.fn = lib.MsliteLlmGemv

    def __call__(self):
        rc = self.fn(3, self.params, self.ndims, self.shapes, self.dtypes, None, None)
        if rc != 0:
            raise RuntimeError(f"MsliteLlmGemv returned {rc}")


class Cycle:
    """Calls fns in turn: with several copies of W, each call reads weights that are not in the cache."""

    def __init__(self, fns):
        self.fns, self.i = fns, 0

    def __call__(self):
        fn = self.fns[self.i]
        self.i = (self.i + 1) % len(self.fns)
        return fn()


def best_seconds(fn, seconds: float, repeat: int, sync=None) -> float:
    """Best over `repeat` runs of the mean time per call; a run lasts about seconds / repeat.
    sync(result of the last call) waits for it, for an engine that may run asynchronously."""
    sync = sync or (lambda _: None)
    sync(fn())
    t0 = time.perf_counter()
    sync(fn())
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(1, int(seconds / repeat / once))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls - 1):
            fn()
        sync(fn())
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,100,512", help="rows of x (M), comma separated")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"OxI, comma separated, of {','.join(SHAPES)}")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma separated, of {','.join(ENGINES)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=0.6, help="time per cell")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warm", action="store_true", help="one copy of W per engine: small matrices then stay in L3")
    p.add_argument("--cold_mib", type=int, default=96, help="without --warm: copies of W per engine, at least this")
    args = p.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    engines = [e for e in args.engines.split(",") if e]
    for e in engines:
        if e not in ENGINES:
            p.error(f"unknown engine {e}")
    path = cpu_kernels.library_path()
    if path is None and any(e.startswith("ours") for e in engines):
        sys.exit(f"the kernel library is not built; {cpu_kernels.BUILD_HINT}")
    lib = ctypes.CDLL(path) if path else None
    isa = "-"
    if lib is not None:
        lib.MsliteLlmSetThreads(ctypes.c_int(args.threads))
        lib.MsliteLlmIsa.restype = ctypes.c_char_p
        isa = lib.MsliteLlmIsa().decode()

    ms = ops = nn = torch = None
    if "ms" in engines:
        import mindspore as ms
        from mindspore import nn, ops

        ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
        try:
            ms.device_context.cpu.op_tuning.threads_num(args.threads)
        except RuntimeError:
            pass
    if "torch" in engines:
        import torch

        torch.set_num_threads(args.threads)

    if ms is not None:
        class MatMulCell(nn.Cell):
            """x . W_k^T for each copy W_k in one graph (switching between graphs costs MindSpore ~0.1 s)."""

            def __init__(self, ws):
                super().__init__()
                self.ws = ms.ParameterTuple([ms.Parameter(ms.Tensor(w), name=f"w{k}", requires_grad=False)
                                             for k, w in enumerate(ws)])
                self.matmul = ops.MatMul(transpose_b=True)

            def construct(self, x):
                out = ()
                for w in self.ws:
                    out = out + (self.matmul(x, w),)
                return out

    print(f"# threads {args.threads}; our kernels' code path: {isa}; cells: ms per call and GFLOP/s (GB/s of weights read at M=1); best of "
          f"{args.repeat}; " + ("weights warm (may sit in the L3 cache)" if args.warm else
                                f"weights cold: each engine cycles through copies of W totalling >= {args.cold_mib} MiB"),
          flush=True)
    header = ["matrix O x I", "M"] + engines
    if "ours_f32" in engines:
        header += [f"f32 vs {e}" for e in ("ms", "torch") if e in engines]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header), flush=True)
    rng = np.random.default_rng(0)
    for key in args.shapes.split(","):
        name, out, inp = SHAPES[key]
        w = rng.standard_normal((out, inp), dtype=np.float32) * 0.05
        stored = {"ours_f32": (w, "float32"), "ours_f16": (w.astype(np.float16), "float16"),
                  "ours_bf16": (to_bf16_bits(w), "bfloat16"), "ms": (w, None), "torch": (w, None)}
        copies = {}  # engine -> its copies of W (the first is W itself)
        for e in engines:
            wk = stored[e][0]
            n = 1 if args.warm else max(1, math.ceil(args.cold_mib * 2 ** 20 / wk.nbytes))
            copies[e] = [wk] + [wk.copy() for _ in range(n - 1)]
        cell_ms = MatMulCell(copies["ms"]) if "ms" in engines else None
        weights_torch = [torch.from_numpy(c) for c in copies["torch"]] if "torch" in engines else []
        for m in rows_list:
            if out > 100000 and m > BIG_ROWS:
                continue
            x = rng.standard_normal((m, inp), dtype=np.float32)
            flops = 2.0 * m * out * inp
            times = {}
            for e in engines:
                if e.startswith("ours"):
                    calls = [Ours(lib, x, c, stored[e][1]) for c in copies[e]]
                    times[e] = best_seconds(Cycle(calls), args.seconds, args.repeat)
                    if e == "ours_f32":  # sanity: against float64
                        ref = x.astype(np.float64) @ w.T.astype(np.float64)
                        err = np.abs(calls[0].y - ref).max() / (np.abs(x) @ np.abs(w).T).max()
                        if err > 1e-5:
                            print(f"WARNING: {key} M={m}: relative error {err:.2e}", file=sys.stderr)
                elif e == "ms":
                    xt = ms.Tensor(x)
                    times[e] = best_seconds(lambda: cell_ms(xt), args.seconds, args.repeat,
                                            sync=lambda ys: ys[-1].asnumpy()) / len(copies["ms"])
                elif e == "torch":
                    xt = torch.from_numpy(x)
                    fns = [(lambda t=t: torch.nn.functional.linear(xt, t)) for t in weights_torch]
                    with torch.inference_mode():
                        times[e] = best_seconds(Cycle(fns), args.seconds, args.repeat)
            cells = [f"{name} {out}x{inp}", str(m)]
            for e in engines:
                t = times[e]
                if m == 1:
                    cells.append(f"{t * 1e3:.3f} ms, {stored[e][0].nbytes / t / 1e9:.1f} GB/s")
                else:
                    cells.append(f"{t * 1e3:.3f} ms, {flops / t / 1e9:.1f} GF/s")
            if "ours_f32" in engines:
                cells += [f"{times[e] / times['ours_f32']:.2f}x" for e in ("ms", "torch") if e in engines]
            print("| " + " | ".join(cells) + " |", flush=True)
        del cell_ms, weights_torch, copies, stored

if __name__ == "__main__":
    main()
