"""A mixture of experts' MLP (qwen3_moe, qwen2_moe) as MindSpore cells, the plain form: the router (a Linear of the
layer's method), a float32 softmax, TopK, the chosen weights divided by their sum with norm_topk_prob, then every
expert's SwiGLU on every row from the stacked weights (export/writers/stacked.py: `experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]) by BatchMatMul, weighted by the routing ([N, E], zero for the experts not chosen) and
summed; Qwen2-MoE's shared expert (an MLP) times sigmoid(shared_expert_gate(x)) added. Plain ops only, so it runs on
the CPU and under GE alike; it reads every expert's weights each call. A `--device cpu` folder with the kernel
library takes the kernels' form instead (KernelExperts: cpu_kernels/moe.cc runs only the chosen experts, on the rows
that chose them, reading nothing of the others), the routing the same graph ops. Parameter names are the graph's:
the router and the shared expert as the checkpoint names them, the stacked experts as transformers 5 holds them in
memory (docs/architecture.md, "Mixture of experts")."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from export.config import ModelConfig
from export.network.layers import ew_add, ew_mul, ew_silu
from export.network.matmul import lazy_parameter


class Dense32(nn.Cell):
    """y = x @ W^T in float32 from W as stored (float32 or bfloat16, widened exactly): the router, the shared expert
    and its gate. Not the CPU kernels' methods, whose AVX512-BF16 form rounds x to bfloat16: the routing would then
    move with that rounding, which the reference does not model."""

    def __init__(self, in_features: int, out_features: int, dtype) -> None:
        super().__init__()
        self.weight = lazy_parameter((out_features, in_features), dtype, "weight")
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        return self.matmul(x, ops.cast(self.weight, ms.float32))


class SharedExpert(nn.Cell):
    """Qwen2-MoE's shared expert: down(silu(gate(x)) * up(x)), in float32."""

    def __init__(self, hidden: int, intermediate: int, dtype) -> None:
        super().__init__()
        self.gate_proj = Dense32(hidden, intermediate, dtype)
        self.up_proj = Dense32(hidden, intermediate, dtype)
        self.down_proj = Dense32(intermediate, hidden, dtype)

    def construct(self, x):
        return self.down_proj(ew_mul(ew_silu(self.gate_proj(x)), self.up_proj(x)))


class Experts(nn.Cell):
    def __init__(self, cfg: ModelConfig, dtype) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.e, self.i = e, i
        self.gate_up_proj = lazy_parameter((e, 2 * i, h), dtype, "gate_up_proj")
        self.down_proj = lazy_parameter((e, h, i), dtype, "down_proj")
        self.bmm = ops.BatchMatMul(transpose_b=True)
        self.sum = ops.ReduceSum()

    def construct(self, x, routing):  # x [N, H] float32, routing [N, E] float32 -> [N, H]
        n, h = x.shape
        xe = ops.broadcast_to(ops.expand_dims(x, 0), (self.e, n, h))
        gu = self.bmm(xe, ops.cast(self.gate_up_proj, ms.float32))  # [E, N, 2I]
        gate, up = ops.split(gu, self.i, axis=-1)
        out = self.bmm(ew_mul(ew_silu(gate), up), ops.cast(self.down_proj, ms.float32))  # [E, N, H]
        weights = ops.broadcast_to(ops.expand_dims(ops.transpose(routing, (1, 0)), -1), out.shape)
        return self.sum(ew_mul(out, weights), 0)


class KernelExperts(nn.Cell):
    """The experts through the CPU kernels (cpu_kernels.MOE_EXPERTS): each row's chosen experts from the stacked
    weights (the same Parameters as Experts'), weighted and summed; an expert no row chose is not read."""

    def __init__(self, cfg: ModelConfig, dtype) -> None:
        super().__init__()
        import cpu_kernels

        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = lazy_parameter((e, 2 * i, h), dtype, "gate_up_proj")
        self.down_proj = lazy_parameter((e, h, i), dtype, "down_proj")
        self.op = ops.Custom(cpu_kernels.local_func(cpu_kernels.MOE_EXPERTS), out_shape=lambda x, *_: x,
                             out_dtype=lambda x, *_: x, func_type="aot")

    def construct(self, x, index, weights):  # x [N, H] float32, index [N, k] int32, weights [N, k] float32
        return self.op(x, index, weights, self.gate_up_proj, self.down_proj)


class SparseMoeBlock(nn.Cell):
    """`dtype`: the weights' storage dtype (the folder's matrices'); the block computes in float32. `kernels`: the
    experts through the CPU kernels (KernelExperts), else every expert by BatchMatMul (Experts)."""

    def __init__(self, cfg: ModelConfig, dtype, kernels: bool = False) -> None:
        super().__init__()
        self.top_k, self.experts_n, self.norm = cfg.num_experts_per_tok, cfg.num_experts, cfg.norm_topk_prob
        self.gate = Dense32(cfg.hidden_size, cfg.num_experts, dtype)
        self.kernels = kernels
        self.experts = KernelExperts(cfg, dtype) if kernels else Experts(cfg, dtype)
        shared = cfg.shared_expert_intermediate_size
        if shared:
            self.shared_expert = SharedExpert(cfg.hidden_size, shared, dtype)
            self.shared_expert_gate = Dense32(cfg.hidden_size, 1, dtype)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.one_hot = ops.OneHot()
        self.sum, self.sum_keep = ops.ReduceSum(), ops.ReduceSum(keep_dims=True)
        self.on, self.off = ms.Tensor(1.0, ms.float32), ms.Tensor(0.0, ms.float32)

    def construct(self, x, valid_length=None):  # [N, H] -> [N, H]
        x = ops.cast(x, ms.float32)
        probs = ops.softmax(self.gate(x), -1)  # [N, E]
        top, index = ops.topk(probs, self.top_k)  # [N, k], descending
        if self.norm:
            top = top / ops.broadcast_to(self.sum_keep(top, -1), top.shape)
        if self.kernels:
            y = self.experts(x, ops.cast(index, ms.int32), top)
        else:
            chosen = self.one_hot(index, self.experts_n, self.on, self.off)  # [N, k, E]
            routing = self.sum(ew_mul(chosen, ops.broadcast_to(ops.expand_dims(top, -1), chosen.shape)), 1)
            y = self.experts(x, routing)
        if self.shared_expert is not None:
            g = ops.sigmoid(self.shared_expert_gate(x))  # [N, 1]
            s = self.shared_expert(x)
            y = ew_add(y, ew_mul(s, ops.broadcast_to(g, s.shape)))
        return y

    def few_rows(self, x):
        return self.construct(x)
