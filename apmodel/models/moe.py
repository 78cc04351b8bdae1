"""DeepSeek-MoE-style decoder: LLaMA-3 attention blocks whose FFN is a mixture of experts
(shared experts that see every token + routed experts chosen by top-k gating).

Routed expert weights are stacked into 3-D parameters (``experts.w1: [E, dim, hidden]`` etc.),
as torchtitan's grouped experts. Two routings compute the same function:

* ``routing="sparse"`` (the presets): each token goes to its top-k experts only (dropless: no
  capacity limit, no token dropped), through the ``local_map`` region :class:`RoutedExperts`:
  tokens are permuted by expert, sent with an all-to-all to the ranks holding their experts when
  the plan shards the experts (expert parallelism), run through each expert's SwiGLU and sent
  back. Compute is proportional to the routed tokens (``top_k`` experts per token).
* ``routing="dense"``: every routed expert runs on every token (batched matmuls with static
  shapes) and its output is multiplied by a gate weight that is zero unless the expert is among
  the token's top-k. ``n_routed_experts / top_k`` times the routed FLOPs (10.7x on
  deepseek-moe-16b); kept as the independent reference the sparse path is tested against.

The routed experts run as one grouped GEMM per weight (:class:`ExpertGroups`): ``torch._grouped_mm``
where it runs on the operands (CPU; CUDA bf16 on Hopper and Blackwell), else one batched matmul
over the groups padded to the largest; never a kernel per expert.

Expert-parallel pricing: which rank receives how many tokens depends on the data, so the region
is priced at uniform routing with the busiest rank receiving :data:`EXPERT_LOAD_IMBALANCE` times
the mean (its all-to-all bytes and its expert matmuls, traced through the same
:class:`ExpertGroups`: the grouped kernel on meta bf16 tensors, a plain ``bmm`` otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from apmodel._torch_private import grouped_mm, grouped_mm_runs
from apmodel.graph.regions import LocalRegion, RegionComm, local_map, region_comm
from apmodel.models.llama3 import Attention, FeedForward, LlamaConfig, RMSNorm, Transformer

#: Tokens the busiest expert-parallel rank receives over the mean, assumed in pricing (routing is
#: data dependent). 1.25 is the capacity factor Switch Transformer trains with (Fedus et al.
#: 2022, §2.1): a balanced router's busiest rank is taken to stay within it.
EXPERT_LOAD_IMBALANCE = 1.25

ROUTINGS = ("sparse", "dense")


@dataclass
class MoEConfig(LlamaConfig):
    """Sizes of a DeepSeek-MoE-style model. Defaults are DeepSeekMoE 16B (DeepSeek-AI, 2024:
    2 shared + 64 routed experts, top-6, first layer dense), with GQA attention instead of MHA.
    The attention and dense fields are the LLaMA ones (the attention block is shared)."""

    dim: int = 2048
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 16
    vocab_size: int = 102400
    ffn_hidden_dim: int = 10944  # dense FFN of the first n_dense_layers layers
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    moe_hidden_dim: int = 1408  # hidden size of each (shared or routed) expert
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    top_k: int = 6
    n_dense_layers: int = 1
    routing: str = "sparse"  # "sparse" (top-k dispatch, the region) or "dense" (see the module doc)
    # the top-k router probabilities divided by their sum (Qwen3-MoE's norm_topk_prob; DeepSeekMoE: no)
    renormalize_topk: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()  # head sizes and attention backend
        if self.routing not in ROUTINGS:
            raise ValueError(f"MoEConfig: routing={self.routing!r} not in {ROUTINGS}")
        if not 1 <= self.top_k <= self.n_routed_experts:
            raise ValueError(
                f"MoEConfig: top_k={self.top_k} must be in [1, n_routed_experts={self.n_routed_experts}]"
            )


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts with stacked weights; ``x: [n, tokens, dim] -> [n, tokens, dim]``."""

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3), self.w2)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)


class ExpertGroups:
    """Rows grouped by expert, ``sizes[i]`` consecutive rows for expert ``i`` (``counts``: the same
    as an int64 tensor on the rows' device). :meth:`matmul` multiplies every group by its expert's
    matrix in one kernel: ``torch._grouped_mm`` where it runs on the operands
    (:func:`apmodel._torch_private.grouped_mm_runs`), else one ``bmm`` over the groups padded with
    zero rows to the largest (no padding when the groups are equal)."""

    def __init__(self, counts: torch.Tensor, sizes: Sequence[int]) -> None:
        if counts.dim() != 1 or len(sizes) != counts.shape[0] or any(s < 0 for s in sizes):
            raise ValueError(f"expert groups: {len(sizes)} sizes {list(sizes)[:8]} do not match counts of shape "
                             f"{tuple(counts.shape)}")
        self.counts, self.sizes = counts, [int(s) for s in sizes]
        self.rows, self.width = sum(self.sizes), max(self.sizes, default=0)
        self._offsets: torch.Tensor | None = None  # int32 cumulative ends (the grouped kernel's offs)
        self._slots: torch.Tensor | None = None  # each row's slot in the padded [groups * width] rows

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x [rows, k]`` (grouped as above) times ``w [groups, k, n]`` -> ``[rows, n]``."""
        groups, k, n = w.shape
        if x.shape != (self.rows, k) or groups != len(self.sizes):
            raise ValueError(f"expert groups: rows {tuple(x.shape)} and weights {tuple(w.shape)} do not fit "
                             f"{len(self.sizes)} groups of {self.rows} rows in all")
        if grouped_mm_runs(x, w):
            if self._offsets is None:
                self._offsets = self.counts.cumsum(0).to(torch.int32)
            return grouped_mm(x, w, self._offsets)
        if all(s == self.width for s in self.sizes):
            return torch.bmm(x.view(groups, self.width, k), w).view(self.rows, n)
        if self._slots is None:
            starts = self.counts.cumsum(0) - self.counts
            first_slot = torch.arange(groups, device=x.device) * self.width - starts  # row r of group g: slot
            self._slots = torch.arange(self.rows, device=x.device) + first_slot.repeat_interleave(self.counts,
                                                                                                  output_size=self.rows)
        padded = x.new_zeros(groups * self.width, k).index_copy(0, self._slots, x)
        return torch.bmm(padded.view(groups, self.width, k), w).view(groups * self.width, n).index_select(0, self._slots)

    def swiglu(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
        """Each group through its expert's SwiGLU (``w1, w3 [groups, dim, hidden]``, ``w2 [groups,
        hidden, dim]``): three grouped GEMMs."""
        return self.matmul(F.silu(self.matmul(x, w1)) * self.matmul(x, w3), w2)


@dataclass(frozen=True)
class RoutedExperts:
    """The routed experts of one MoE layer on local shards (the function of a ``local_map`` region).

    ``tokens [t, dim]``, router probabilities ``probs [t, E]`` and this rank's experts' weights
    ``w1, w3 [e, dim, hidden]``, ``w2 [e, hidden, dim]`` -> ``[t, dim]``: each token's top-k experts'
    SwiGLU outputs weighted by their probabilities (DeepSeekMoE: no renormalisation).

    Alternatives, per mesh axis: ``expert_parallel`` (tokens and experts split; tokens travel to
    their experts' ranks and back by all-to-all over the axis), ``data_parallel`` (tokens split,
    every expert whole) and ``tensor_parallel`` (each expert's hidden units split, tokens whole;
    partial outputs). On one device (or replicated) it is a plain sparse dispatch."""

    top_k: int
    renormalize: bool = False  # divide each token's top-k probabilities by their sum

    ALTERNATIVES: ClassVar[dict] = {
        "expert_parallel": (("S(0)", "S(0)", "S(0)", "S(0)", "S(0)"), ("S(0)",)),
        "data_parallel": (("S(0)", "S(0)", "R", "R", "R"), ("S(0)",)),
        "tensor_parallel": (("R", "R", "S(2)", "S(1)", "S(2)"), ("P",)),
    }

    def region(self) -> LocalRegion:
        name = f"routed_experts_top{self.top_k}" + ("_renormalized" if self.renormalize else "")
        return local_map(self, name=name, alternatives=self.ALTERNATIVES)

    def __call__(self, x: torch.Tensor, probs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 w3: torch.Tensor) -> torch.Tensor:
        ep = region_comm("expert_parallel")
        n_experts, local = probs.shape[1], w1.shape[0]
        if local * ep.size != n_experts:
            raise ValueError(f"routed experts: {local} local experts x {ep.size} expert-parallel ranks != "
                             f"{n_experts} experts")
        gate, expert = probs.topk(self.top_k, dim=-1)  # [t, k]
        if self.renormalize:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        if x.device.type == "meta":
            returned = self._uniform(x, w1, w2, w3, ep)
        else:
            returned = self._dispatch(x, expert, w1, w2, w3, ep)
        return (returned.view(*gate.shape, x.shape[1]) * gate.unsqueeze(-1)).sum(dim=1)

    def _dispatch(self, x: torch.Tensor, expert: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor, ep: RegionComm) -> torch.Tensor:
        """The (token, slot) pairs' expert outputs ``[t * k, dim]`` in (token, slot) order."""
        local = w1.shape[0]
        flat = expert.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs by expert, so by the rank that holds it
        rows = x[order // self.top_k]
        sent_per_expert = torch.bincount(flat, minlength=local * ep.size)
        # recv_counts[j, i]: rows rank j sends to this rank's expert i
        recv_counts = ep.all_to_all(sent_per_expert.view(-1, 1), [local] * ep.size, [local] * ep.size).view(ep.size, local)
        send_rows = sent_per_expert.view(ep.size, local).sum(dim=1).tolist()
        recv_rows = recv_counts.sum(dim=1).tolist()
        got = ep.all_to_all(rows, send_rows, recv_rows)  # by source rank, then expert
        expert_of_row = torch.arange(local, device=x.device).repeat(ep.size).repeat_interleave(recv_counts.flatten())
        by_expert = torch.argsort(expert_of_row, stable=True)
        per_expert = recv_counts.sum(dim=0)
        groups = ExpertGroups(per_expert, per_expert.tolist())
        done = groups.swiglu(got[by_expert], w1, w2, w3)[torch.argsort(by_expert)]
        back = ep.all_to_all(done, recv_rows, send_rows)
        return back[torch.argsort(order)]

    def _uniform(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                 ep: RegionComm) -> torch.Tensor:
        """Shapes and ops of :meth:`_dispatch` at uniform routing (meta tensors: tracing and
        pricing), the busiest rank receiving EXPERT_LOAD_IMBALANCE x the mean under expert
        parallelism, its rows grouped evenly over its experts (a grouped matmul)."""
        t, dim = x.shape
        local = w1.shape[0]
        pairs = t * self.top_k
        rows = x[torch.arange(t, device=x.device).repeat_interleave(self.top_k)]
        load = EXPERT_LOAD_IMBALANCE if ep.size > 1 else 1.0
        per_expert = math.ceil(pairs * load / local)
        send = [pairs // ep.size + (j < pairs % ep.size) for j in range(ep.size)]
        recv = [per_expert * local // ep.size + (j < per_expert * local % ep.size) for j in range(ep.size)]
        if ep.size > 1:  # the per-expert counts first, as _dispatch exchanges them
            ep.all_to_all(x.new_empty(local * ep.size, 1, dtype=torch.int64), [local] * ep.size, [local] * ep.size)
        got = ep.all_to_all(rows, send, recv) if ep.size > 1 else rows.new_empty(per_expert * local, dim)
        counts = torch.full((local,), per_expert, dtype=torch.int64, device=x.device)
        done = ExpertGroups(counts, [per_expert] * local).swiglu(got, w1, w2, w3)
        return done[:pairs] if ep.size == 1 else ep.all_to_all(done, recv, send)


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.n_routed = cfg.n_routed_experts
        self.routing = cfg.routing
        self.renormalize = cfg.renormalize_topk
        self.router = nn.Linear(cfg.dim, cfg.n_routed_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_routed_experts, cfg.dim, cfg.moe_hidden_dim)
        # the shared experts act as one SwiGLU of width n_shared * moe_hidden (as in DeepSeek's code)
        self.shared_experts = (FeedForward(cfg.dim, cfg.n_shared_experts * cfg.moe_hidden_dim)
                               if cfg.n_shared_experts else None)

    def gate_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Dense gate ``[tokens, n_routed]``: softmax router probability for the top-k experts of each
        token, 0 for the others (DeepSeekMoE: no renormalisation over the top-k; ``renormalize_topk``:
        divided by their sum, as Qwen3-MoE does)."""
        probs = F.softmax(self.router(x), dim=-1)
        kth_largest = torch.topk(probs, self.top_k, dim=-1).values[:, -1:]
        gates = probs * (probs >= kth_largest).to(probs.dtype)
        return gates / gates.sum(dim=-1, keepdim=True) if self.renormalize else gates

    def routed_region(self, tokens: torch.Tensor) -> tuple[LocalRegion, torch.Tensor]:
        """The sparse path's region and the ``[tokens, n_routed]`` scores whose top-k it follows:
        here the softmax router probabilities (the region takes the top-k and renormalises them
        when asked)."""
        return RoutedExperts(self.top_k, self.renormalize).region(), F.softmax(self.router(tokens), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, dim = x.shape
        tokens = x.reshape(bs * seq, dim)
        if self.routing == "sparse":
            region, scores = self.routed_region(tokens)
            w = self.experts
            combined = region(tokens, scores, w.w1, w.w2, w.w3)
        else:
            gates = self.gate_weights(tokens)  # [tokens, E]
            routed = self.experts(tokens.unsqueeze(0).expand(self.n_routed, -1, -1))  # [E, tokens, dim]
            combined = (routed * gates.t().unsqueeze(-1)).sum(dim=0)
        if self.shared_experts is not None:
            combined = combined + self.shared_experts(tokens)
        return combined.view(bs, seq, dim)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.router.weight, mean=0.0, std=init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)


class MoEBlock(nn.Module):
    def __init__(self, layer_id: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.attention = self.make_attention(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe_enabled = layer_id >= cfg.n_dense_layers
        if self.moe_enabled:
            self.moe = self.make_moe(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)
        self.init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def make_attention(self, cfg: MoEConfig) -> nn.Module:
        """The attention of the block (subclasses swap it, e.g. multi-head latent attention)."""
        return Attention(cfg)

    def make_moe(self, cfg: MoEConfig) -> nn.Module:
        """The MoE feed-forward of the block (subclasses swap the routing)."""
        return MoE(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(self.init_std)  # type: ignore[operator]  # nn.Module.__getattr__ says Tensor | Module
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(self.init_std)  # type: ignore[operator]  # as above


class MoETransformer(Transformer):
    """``tokens [batch, seq] (int64) -> logits [batch, seq, vocab]`` (or the loss, given targets):
    the LLaMA-3 decoder with MoE blocks (see :class:`MoEBlock`)."""

    def make_block(self, layer_id: int, cfg: LlamaConfig) -> nn.Module:
        return MoEBlock(layer_id, cast(MoEConfig, cfg))  # Transformer passes its own config, a MoEConfig here
