"""The matmul methods of linear layers, and the one place that chooses them (docs/architecture.md, "Graph forms").

As vLLM's `LinearBase(quant_method=...)`: each linear layer (export/network/layers.py Linear) gets its method when it is
built, and the method owns how the weight is stored (its Parameters) and how x . W^T is computed. A new weight
format is a new method here, never a flag threaded through the layers. The methods:
- PlainMatmul: MindSpore's MatMul (plain graphs on the CPU, every Atlas float folder);
- KernelMatmul: mslite-llm's CPU kernel (cpu_kernels/gemv.cc), float32, float16 or bfloat16 matrices widened in
  registers, in the decode step and (for 16-bit matrices, or a few rows) in the full graph;
- QuantMatmul: int8/int4 weights with scales (export/network/quantize.py has the format): Ascend's WeightQuantBatchMatmul in
  Atlas graphs (a CPU stand-in at load: lite_runtime/backends/standins.py), cpu_kernels/matmul_quant.cc in CPU graphs
  (where the fused decode ops read the same integers).

`Form` is what a network is built of, chosen once by CausalLM from the export's settings: whether the CPU kernels'
fused decode ops run the layers, the method factory of the linear layers and of the tables (embedding, head).

Every method is called as method(x, weight, scale, offset, bias, valid_length, few): scale and offset are None for
float weights, bias None when the layer has none (or adds it after a tensor-parallel AllReduce), valid_length [B]
only in the full graph (a kernel may skip the padding rows), few True in the decode step.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import initializer

# Full graphs of at most this many rows (batch x prompt tokens) use our kernel for their matmuls even in float32
# folders: there it runs its GEMV form, 1.6x faster than MindSpore's MatMul on a 16-token prompt of the 0.5B shape
# (0.155 -> 0.098 s), while from 100 tokens on MatMul is 5-10 % ahead (docs/performance-log.md, "The decode step:
# where the time goes, and fused ops", 2026-11-23; that is oneDNN's AVX-512 path: on AVX2 our GEMM is ~20 % ahead
# at 100 tokens, not yet the default: the same log, "Load to first token: the full graph in the decode step's
# kernels, and their attention", 2026-11-25).
KERNEL_PREFILL_MAX_ROWS = 16


def lazy_parameter(shape, dtype, name: str) -> Parameter:
    """Lazy zeros: nothing is allocated. Export compiles the graphs from shapes and dtypes alone and writes the data
    straight from the checkpoint (export/writers/graphs.py, export/writers/weights_file.py).

    MindSpore's Parameter materializes its initializer at construction (`init_data()`) unless its class says
    `init_param = False` (read from the class, so it is set on Parameter for the call: a subclass is not kept, the
    Parameter's type is made anew). For most dtypes those are calloc'd zeros no page of which is touched, but
    qint4x2 zeros are written out: a 7B int4 network held 3.4 GiB before anything compiled (measured 2026-11-26)."""
    saved = Parameter.__dict__.get("init_param")
    Parameter.init_param = False
    try:
        return Parameter(initializer("zeros", shape, dtype), name=name, requires_grad=False)
    finally:
        if saved is None:
            del Parameter.init_param
        else:
            Parameter.init_param = saved


def ew_add(a, b):
    """a + b; AddN for float16 (export/network/layers.py, FLOAT16: MindSpore's CPU Add has no fast path for it)."""
    return ops.addn((a, b)) if a.dtype == ms.float16 else a + b


def _add(y, bias):
    """y + bias with the bias broadcast explicitly (export/network/layers.py, BROADCASTS); the depend keeps MindSpore from
    running every layer's broadcast at graph start."""
    return ew_add(y, ops.broadcast_to(ops.depend(bias, y), y.shape))


class MatmulMethod(nn.Cell):
    """How one linear layer stores W [O, I] and computes x . W^T (+ b)."""

    def storage(self, out_features: int, in_features: int, dtype):
        """(weight, scale or None, offset or None): the layer's Parameters, lazily zero."""
        raise NotImplementedError


class PlainMatmul(MatmulMethod):
    def __init__(self, weight_dtype=None) -> None:
        super().__init__()
        self.weight_dtype = weight_dtype
        self.matmul = ops.MatMul(transpose_b=True)

    def storage(self, out_features: int, in_features: int, dtype):
        return lazy_parameter((out_features, in_features), self.weight_dtype or dtype, "weight"), None, None

    def construct(self, x, weight, scale=None, offset=None, bias=None, valid_length=None, few=False):
        y = self.matmul(x, weight)
        return y if bias is None else _add(y, bias)


def kernel_matmul(with_bias: bool, prompt_rows: bool = False):
    """Our CPU matmul kernel as an aot Custom op (cpu_kernels/gemv.cc): x [N, I] float32 . W[O, I]^T (+ b [O])
    -> [N, O] float32, W float32, float16 or bfloat16 (widened in registers); any N, GEMV or blocked GEMM.
    `prompt_rows`: the full graph's form, with valid_length [B] as the last input, computing only each row's
    prompt tokens (cpu_kernels.GEMM_VALID), so a prompt costs its length, not its bucket's."""
    import cpu_kernels

    name = cpu_kernels.GEMM_VALID if prompt_rows else cpu_kernels.GEMV_BIAS if with_bias else cpu_kernels.GEMV
    return ops.Custom(cpu_kernels.local_func(name), out_shape=lambda x, w, *_: (x[0], w[0]),
                      out_dtype=lambda x, *_: x, func_type="aot")


class KernelMatmul(MatmulMethod):
    """Our CPU kernel in the decode step (and in full graphs of at most KERNEL_PREFILL_MAX_ROWS rows); in the full
    graph too when `prompt` (16-bit matrices: only our kernel reads them). `with_bias`: the kernel adds the bias."""

    def __init__(self, prompt: bool, weight_dtype, with_bias: bool) -> None:
        super().__init__()
        self.prompt, self.weight_dtype, self.with_bias = prompt, weight_dtype, with_bias
        self.kernel = kernel_matmul(with_bias)
        self.kernel_valid = kernel_matmul(with_bias, prompt_rows=True)
        self.plain = PlainMatmul()

    def storage(self, out_features: int, in_features: int, dtype):
        return lazy_parameter((out_features, in_features), self.weight_dtype or dtype, "weight"), None, None

    def construct(self, x, weight, scale=None, offset=None, bias=None, valid_length=None, few=False):
        # static shapes: which op runs is decided when the graph is compiled
        if not (few or self.prompt or x.shape[0] <= KERNEL_PREFILL_MAX_ROWS):
            return self.plain(x, weight, None, None, bias)
        if valid_length is not None and not few:  # the full graph: the padding rows are skipped
            if bias is not None:
                return self.kernel_valid(x, weight, bias, valid_length)
            return self.kernel_valid(x, weight, valid_length)
        if bias is not None:
            return self.kernel(x, weight, bias)
        return self.kernel(x, weight)


class QuantMatmul(MatmulMethod):
    """A quantized linear layer (export/network/quantize.py has the format): y = x . W^T with
    W[o, i] = (q[o, i] + offset[i // g, o]) * scale[i // g, o], q int8 [O, I] or int4 packed [O, I / 2].

    `atlas`: Ascend's WeightQuantBatchMatmul (float16/bfloat16 x, the weight transposed as [N, K], per-group scale
    (K / g, N)); the `ms` backend replaces it by a CPU stand-in when it loads the graph (lite_runtime/backends/
    standins.py). Else mslite-llm's CPU kernel (cpu_kernels/quant.cc), float32 x. One weight format for both."""

    def __init__(self, bits: int, group_size: int, symmetric: bool, atlas: bool) -> None:
        super().__init__()
        self.bits, self.group_size, self.symmetric, self.atlas = bits, group_size, symmetric, atlas
        if atlas:
            from mindspore.ops.auto_generate import WeightQuantBatchMatmul

            self.op = WeightQuantBatchMatmul(False, True, group_size)
        else:
            import cpu_kernels

            name = cpu_kernels.QUANT_MATMUL if symmetric else cpu_kernels.QUANT_MATMUL_OFFSET
            self.op = ops.Custom(cpu_kernels.local_func(name), out_shape=lambda x, w, s, *_: (x[0], s[1]),
                                 out_dtype=lambda x, *_: x, func_type="aot")
            # the full graph: only each row's prompt tokens computed (a 100-token prompt in the 128-token graph:
            # 0.77x -> ~1x llama.cpp's Q4_0 prefill time at the 0.5B shape; docs/performance-log.md, section 30)
            name = cpu_kernels.QUANT_MATMUL_VALID if symmetric else cpu_kernels.QUANT_MATMUL_OFFSET_VALID
            self.op_valid = ops.Custom(cpu_kernels.local_func(name), out_shape=lambda x, w, s, *_: (x[0], s[1]),
                                       out_dtype=lambda x, *_: x, func_type="aot")

    def storage(self, out_features: int, in_features: int, dtype):
        if self.bits == 4:
            weight = lazy_parameter((out_features, in_features // 2), ms.qint4x2 if self.atlas else ms.uint8,
                                    "weight")
        else:
            weight = lazy_parameter((out_features, in_features), ms.int8, "weight")
        groups = 1 if self.group_size == 0 else in_features // self.group_size
        scale = lazy_parameter((groups, out_features), dtype, "weight_scale")
        offset = None if self.symmetric else lazy_parameter((groups, out_features), dtype, "weight_offset")
        return weight, scale, offset

    def construct(self, x, weight, scale=None, offset=None, bias=None, valid_length=None, few=False):
        if self.atlas:
            y = self.op(x, weight, scale, offset, None, None, None)
        elif valid_length is not None and not few:  # the full graph: the padding rows are skipped
            y = self.op_valid(x, weight, scale, valid_length) if offset is None else self.op_valid(
                x, weight, scale, offset, valid_length)
        elif offset is None:
            y = self.op(x, weight, scale)
        else:
            y = self.op(x, weight, scale, offset)
        return y if bias is None else _add(y, bias)


Factory = Callable[[bool], MatmulMethod]  # with_bias -> a method for one layer


class Form(NamedTuple):
    """What a network's layers are built of, chosen once (CausalLM). `decode_ops`: the CPU kernels' fused decode
    ops run the layers (norm + q/k/v + RoPE + cache write, attention, o_proj + residual, norm + SwiGLU, ...: export/
    layers.py), which read 16- or 32-bit matrices. `linear`: each linear layer's method. `table`: the head's method
    (a tied model's head is the embedding's table). `table_dtype`: a float table's storage dtype when it is not the
    compute dtype (our embedding kernel reads it). `embedding`: in a quantized folder, the embedding's QuantMethod
    when it is quantized (export/network/quantize.py TablePlan), else None: float."""

    decode_ops: bool = False
    linear: Factory = lambda with_bias: PlainMatmul()
    table: Factory = lambda with_bias: PlainMatmul()
    table_dtype: Any = None
    embedding: Any = None


def choose_form(kernels: bool, prompt_kernels: bool, weight_dtype, quant=None, atlas: bool = False,
                tables=None) -> Form:
    """The form of a network: `kernels` (a CPU folder with our kernel library), `prompt_kernels` (the full graph's
    matmuls through them too: 16-bit matrices), `weight_dtype` (the matrices' storage dtype when it is not the
    compute dtype), `quant` (export/checkpoints/methods.py QuantMethod of the linear layers, or None), `tables` (a quantized
    folder's export/network/quantize.py TablePlan: each table quantized by its method, or float as a float folder's)."""
    if kernels:
        def float_method(with_bias: bool) -> MatmulMethod:
            return KernelMatmul(prompt_kernels, weight_dtype, with_bias)
    else:
        def float_method(with_bias: bool) -> MatmulMethod:
            return PlainMatmul()
    if quant is None:
        return Form(kernels, float_method, float_method, weight_dtype) if kernels else Form()

    # a quantized folder: one quantized matmul per linear layer. On the CPU the fused decode ops run the layers,
    # reading the integers as the matmul does (cpu_kernels/decode_ops.cc: a weight is its q, scale[, offset]); on
    # Atlas the plain form around WeightQuantBatchMatmul (or the fused form, from export/network/atlas_layers.py)
    def linear(with_bias: bool) -> MatmulMethod:
        return QuantMatmul(quant.bits, quant.group_size, quant.symmetric, atlas)

    head = None if tables is None else (tables.embedding if tables.tied else tables.head)
    if head is None:
        table = float_method
    else:
        def table(with_bias: bool) -> MatmulMethod:
            return QuantMatmul(head.bits, head.group_size, head.symmetric, atlas)

    return Form(kernels and not atlas, linear, table, weight_dtype if kernels else None,
                None if tables is None else tables.embedding)


def is_quantized(method: Optional[MatmulMethod]) -> bool:
    return isinstance(method, QuantMatmul)
