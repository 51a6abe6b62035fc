"""A mixture of experts' MLP (qwen3_moe, qwen2_moe) as MindSpore cells, the plain form: the router (float32 products
of its stored weights), a float32 softmax, TopK, the chosen weights divided by their sum with norm_topk_prob, then every
expert's SwiGLU on every row from the stacked weights (export/writers/stacked.py: `experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]) by BatchMatMul, weighted by the routing ([N, E], zero for the experts not chosen) and
summed; Qwen2-MoE's shared expert (a dense MLP of the network's form) times sigmoid(shared_expert_gate(x)) added. Plain ops only, so it runs on
the CPU and under GE alike; it reads every expert's weights each call. A `--device cpu` folder with the kernel
library takes the kernels' form instead: one op (cpu_kernels/moe.cc) routes in float32 as above and runs only the
chosen experts, on the rows that chose them, reading nothing of the others (KernelExperts holds its weights); after
the attention it also takes the norm and the residual (SparseMoeBlock.residual). Parameter names are the graph's:
the router and the shared expert as the checkpoint names them, the stacked experts as transformers 5 holds them in
memory (docs/architecture.md, "Mixture of experts")."""
from __future__ import annotations

import dataclasses

import mindspore as ms
from mindspore import nn, ops

from export.config import ModelConfig
from export.network.layers import ew_add, ew_mul, ew_silu
from export.network.matmul import lazy_parameter


class Dense32(nn.Cell):
    """y = x @ W^T in float32 from W as stored (float32 or bfloat16, widened exactly): the router and the shared
    expert's gate. Not the CPU kernels' methods, whose AVX512-BF16 form rounds x to bfloat16: the routing would then
    move with that rounding, which the reference does not model."""

    def __init__(self, in_features: int, out_features: int, dtype) -> None:
        super().__init__()
        self.weight = lazy_parameter((out_features, in_features), dtype, "weight")
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        return self.matmul(x, ops.cast(self.weight, ms.float32))


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


class FusedExperts(nn.Cell):
    """The Atlas fused form (`--graph fused`), as vllm-mindspore's dropless tensor-parallel MoE calls Ascend's ops:
    MoeGatingTopKSoftmax (a float32 softmax of the router's float32 logits and its top k), the chosen weights
    divided by their sum with norm_topk_prob, MoeInitRoutingV2 (the rows copied out sorted by expert, the count per
    expert, and where each choice went), GroupedMatmulV4 (each expert's rows times its matrix, the gate and up
    projections as one, then the down projection), the SwiGLU between, and MoeTokenUnpermute (each row's k results
    weighted and summed). Only the chosen experts' matrices are multiplied; the matrices are GroupedMatmul's [E, K, N]
    (`gate_up_proj` [E, H, 2I]: each expert's gate columns, then its up columns; `down_proj` [E, I, H]: the
    transposes of the plain form's, export/writers/stacked.py). The experts compute in the folder's dtype (float16 or
    bfloat16, as GroupedMatmul takes them); the routing in float32. Quantized experts (`quant`, the linear layers'
    QuantMatmul: per channel, as GroupedMatmulV4's antiquant takes int8) are GroupedMatmul's antiquant: q int8
    [E, K, N] or int4 [E, K, N / 2] (qint4x2: two per byte along N), antiquant_scale (and _offset, asymmetric) the
    folder's [E, 1, N] reshaped to [E, N]: y = x @ ((q + offset) * scale). On the CPU the `ms` backend runs these ops
    as stand-ins (lite_runtime/backends/standins.py): `check` there proves the wiring, on the device the kernels."""

    def __init__(self, cfg: ModelConfig, dtype, quant=None) -> None:
        super().__init__()
        from mindspore.ops.auto_generate import (GroupedMatmulV4, MoeGatingTopKSoftmax, MoeInitRoutingV2,
                                                 MoeTokenUnpermute)

        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.e, self.i, self.k, self.norm = e, i, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.dtype = dtype
        self.gate_up_proj, self.gate_up_proj_scale, self.gate_up_proj_offset = self._storage(
            e, h, 2 * i, dtype, quant, "gate_up_proj")
        self.down_proj, self.down_proj_scale, self.down_proj_offset = self._storage(e, i, h, dtype, quant, "down_proj")
        self.top_k_softmax = MoeGatingTopKSoftmax()
        self.init_routing = MoeInitRoutingV2()
        self.grouped_matmul = GroupedMatmulV4()
        self.unpermute = MoeTokenUnpermute()
        self.sum_keep = ops.ReduceSum(keep_dims=True)

    @staticmethod
    def _storage(e: int, k: int, n: int, dtype, quant, name: str):
        """[E, K, N] float, or a quantized one's q and its per-channel scale (and offset) [E, 1, N]."""
        if quant is None:
            return lazy_parameter((e, k, n), dtype, name), None, None
        if quant.group_size:
            raise ValueError("the fused form's quantized experts are per channel (export/pipeline.py _moe_supported)")
        q = lazy_parameter((e, k, n // 2), ms.qint4x2, name) if quant.bits == 4 else lazy_parameter(
            (e, k, n), ms.int8, name)
        scale = lazy_parameter((e, 1, n), dtype, name + "_scale")
        offset = None if quant.symmetric else lazy_parameter((e, 1, n), dtype, name + "_offset")
        return q, scale, offset

    def _grouped(self, x, weight, counts, scale=None, offset=None):
        """x [M, K] rows grouped by expert, counts [E] int64 -> [M, N]; split_item 3, group_type 0 (M),
        group_list_type 1 (counts); a quantized weight's antiquant scale (and offset) [E, N]."""
        scales = None if scale is None else [scale.reshape(scale.shape[0], scale.shape[2])]
        offsets = None if offset is None else [offset.reshape(offset.shape[0], offset.shape[2])]
        return self.grouped_matmul([x], [weight], None, None, None, scales, offsets, None, counts, None, None, None,
                                   3, 0, 1, 0, None)[0]

    def construct(self, x, logits):  # x [N, H] the compute dtype, logits [N, E] float32 -> [N, H] the compute dtype
        top, chosen, _ = self.top_k_softmax(logits, None, self.k)  # [N, k] float32, int32
        if self.norm:
            top = top / ops.broadcast_to(self.sum_keep(top, -1), top.shape)
        # dropless: active_num 0, expert_capacity 0, drop_pad_mode 0; the count per expert (flag 2)
        rows, where, counts, _ = self.init_routing(x, chosen, 0, 0, self.e, 0, 2, False)
        counts = ops.cast(counts, ms.int64)
        gate, up = ops.split(self._grouped(rows, self.gate_up_proj, counts, self.gate_up_proj_scale,
                                           self.gate_up_proj_offset), self.i, axis=-1)
        out = self._grouped(ew_mul(ew_silu(gate), up), self.down_proj, counts, self.down_proj_scale,
                            self.down_proj_offset)
        return self.unpermute(out, where, ops.cast(top, self.dtype), False, None)


class KernelExperts(nn.Cell):
    """The stacked experts as the CPU kernels' MoE op reads them (cpu_kernels.MOE: the router, the routing and each
    row's chosen experts, weighted and summed; an expert no row chose is not read). Float weights are the same
    Parameters as Experts'; quantized ones (`quant`: the layers' QuantMatmul, whose bits, group size and symmetry
    every expert shares) are each stack's q (int8 [E, n, k], int4 packed as uint8 [E, n, k / 2]), `_scale` and,
    asymmetric, `_offset` [E, G, n] in `scale_dtype` (the folder's compute dtype), as export/writers/stacked.py
    writes them."""

    def __init__(self, cfg: ModelConfig, dtype, quant=None, scale_dtype=None) -> None:
        super().__init__()
        import cpu_kernels

        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj, self.gate_up_proj_scale, self.gate_up_proj_offset = self._storage(
            e, 2 * i, h, dtype, quant, scale_dtype, "gate_up_proj")
        self.down_proj, self.down_proj_scale, self.down_proj_offset = self._storage(
            e, h, i, dtype, quant, scale_dtype, "down_proj")
        out = lambda layout, x, *_: x  # noqa: E731  (x, or h in the residual form)
        self.op = ops.Custom(cpu_kernels.local_func(cpu_kernels.MOE), out_shape=out, out_dtype=out, func_type="aot")

    @staticmethod
    def _storage(e: int, n: int, k: int, dtype, quant, scale_dtype, name: str):
        if quant is None:
            return lazy_parameter((e, n, k), dtype, name), None, None
        q = lazy_parameter((e, n, k // 2), ms.uint8, name) if quant.bits == 4 else lazy_parameter(
            (e, n, k), ms.int8, name)
        groups = 1 if quant.group_size == 0 else k // quant.group_size
        scale = lazy_parameter((e, groups, n), scale_dtype, name + "_scale")
        offset = None if quant.symmetric else lazy_parameter((e, groups, n), scale_dtype, name + "_offset")
        return q, scale, offset

    @staticmethod
    def _tensors(q, scale, offset) -> tuple:
        return (q,) if scale is None else (q, scale) if offset is None else (q, scale, offset)

    def weights(self) -> tuple:
        """gate_up's tensors, then down's, as the op takes them."""
        return (self._tensors(self.gate_up_proj, self.gate_up_proj_scale, self.gate_up_proj_offset)
                + self._tensors(self.down_proj, self.down_proj_scale, self.down_proj_offset))


class SparseMoeBlock(nn.Cell):
    """`dtype`: the network's compute dtype; the block computes in float32. `form`: the network's Form (export/network/
    matmul.py), from which it takes the rest: the float matrices' storage dtype, the experts through the CPU kernels
    (KernelExperts, form.decode_ops) or every expert by BatchMatMul (Experts), quantized experts where the linear
    layers are quantized (their method's bits, group and symmetry, the scales in `dtype`; kernels only), and
    Qwen2-MoE's shared expert (a dense MLP of the form). The router and the shared expert's gate stay float32."""

    def __init__(self, cfg: ModelConfig, dtype, form, tp: bool = False, fused: bool = False) -> None:
        super().__init__()
        from export.network.layers import MLP
        from export.network.matmul import is_quantized

        method = form.linear(False)  # one method for every linear layer of the network
        quant = method if is_quantized(method) else None
        storage = getattr(method, "weight_dtype", None) or dtype  # the float matrices' (bfloat16 on a 16-bit CPU folder)
        kernels = form.decode_ops
        self.dtype, self.fused = dtype, fused
        # tensor parallel: `cfg` is one rank's share (every expert's share of its columns); the experts' partial sums
        # are summed by AllReduce, the router and the shared expert (every rank's, whole) computed alike on each
        self.reduce = ops.AllReduce() if tp else None
        self.top_k, self.experts_n, self.norm = cfg.num_experts_per_tok, cfg.num_experts, cfg.norm_topk_prob
        self.gate = Dense32(cfg.hidden_size, cfg.num_experts, storage)
        self.kernels = kernels
        if quant is not None and not (kernels or fused):
            raise ValueError("quantized experts run in the CPU kernels or the fused form (export/pipeline.py "
                             "_moe_supported)")
        if fused:
            self.experts = FusedExperts(cfg, storage, quant)
        else:
            self.experts = KernelExperts(cfg, storage, quant, dtype) if kernels else Experts(cfg, storage)
        if kernels:  # the MoE op's layout: k, norm_topk_prob, and whether it takes the residual form
            import numpy as np

            self.layout = ms.Tensor(np.array([cfg.num_experts_per_tok, int(cfg.norm_topk_prob), 0], np.int32))
            self.layout_residual = ms.Tensor(np.array([cfg.num_experts_per_tok, int(cfg.norm_topk_prob), 1],
                                                      np.int32))
        shared = cfg.shared_expert_intermediate_size
        if shared:  # a dense MLP of the network's form (quantized as its linear layers are), every rank's whole
            # under tensor parallelism; its gate float32, as the router
            self.shared_expert = MLP(dataclasses.replace(cfg, intermediate_size=shared, mlp_bias=False), dtype, form)
            self.shared_expert_gate = Dense32(cfg.hidden_size, 1, storage)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.one_hot = ops.OneHot()
        self.sum, self.sum_keep = ops.ReduceSum(), ops.ReduceSum(keep_dims=True)
        self.on, self.off = ms.Tensor(1.0, ms.float32), ms.Tensor(0.0, ms.float32)

    def construct(self, x, valid_length=None):  # [N, H] -> [N, H], the compute dtype (x's)
        x32 = ops.cast(x, ms.float32)
        if self.fused:  # Ascend's routing and grouped-matmul ops (FusedExperts), in the compute dtype
            y = self.experts(x, self.gate(x32))
        elif self.kernels:  # the router, the routing and the chosen experts in one op (the full graph: each
            # prompt's rows only, valid_length)
            y = self.experts.op(*((self.layout, x32, self.gate.weight) + self.experts.weights()
                                  + (() if valid_length is None else (valid_length,))))
        else:
            probs = ops.softmax(self.gate(x32), -1)  # [N, E]
            top, index = ops.topk(probs, self.top_k)  # [N, k], descending
            if self.norm:
                top = top / ops.broadcast_to(self.sum_keep(top, -1), top.shape)
            chosen = self.one_hot(index, self.experts_n, self.on, self.off)  # [N, k, E]
            routing = self.sum(ew_mul(chosen, ops.broadcast_to(ops.expand_dims(top, -1), chosen.shape)), 1)
            y = self.experts(x32, routing)
        y = ops.cast(y, self.dtype)
        if self.reduce is not None:
            y = self.reduce(y)
        if self.shared_expert is not None:  # the dense MLP in the compute dtype, its gate float32
            g = ops.cast(ops.sigmoid(self.shared_expert_gate(x32)), self.dtype)  # [N, 1]
            s = self.shared_expert(x)
            y = ew_add(y, ew_mul(s, ops.broadcast_to(g, s.shape)))
        return y

    def few_rows(self, x):
        return self.construct(x)

    def residual(self, h, norm, valid_length=None):
        """h + this MLP of norm(h) (`norm`: the layer's post_attention_layernorm), the CPU kernels' way: one op
        where there is no shared expert and no AllReduce (the MoE op's residual form), else the norm's kernel, the op
        (its AllReduce) and the shared expert. valid_length [B]: the full graph's prompts (the op computes only their
        rows)."""
        if self.shared_expert is None and self.reduce is None:
            layout, *rest = self.residual_args(norm)
            return self.experts.op(*((layout, h) + tuple(rest) + (() if valid_length is None else (valid_length,))))
        return ew_add(h, self.construct(norm.few_rows(h), valid_length))

    def residual_args(self, norm) -> tuple:
        """The MoE op's residual form's tensors but h (its layout first), as the decode step's layer op takes them
        (cpu_kernels.DECODE_MOE_LAYER)."""
        return (self.layout_residual, norm.weight, norm.eps_tensor, self.gate.weight) + self.experts.weights()
