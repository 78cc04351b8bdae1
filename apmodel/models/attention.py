"""Causal attention shared by the reference models (the CPU reference kernels of the ops it traces
to live in :mod:`apmodel.core.kernels`).

Why two paths (measured on torch 2.13.0+cpu):

* ``aten._scaled_dot_product_flash_attention`` and ``aten._scaled_dot_product_efficient_attention``
  have no CPU kernel ("Could not run ... with arguments from the 'CPU' backend"), but both run on
  the meta device and DTensor has sharding rules for them and for their backward ops.
  ``F.scaled_dot_product_attention`` on meta decomposes to the math path (bmm + softmax + ...),
  which would make the planner price attention as unfused matmuls, and on fake CPU tensors it becomes
  ``_scaled_dot_product_flash_attention_for_cpu``, which has no DTensor rule.
* So :func:`causal_attention` calls the explicit flash (or efficient) aten op when the tensors are on
  the meta device (tracing), and ``F.scaled_dot_product_attention`` otherwise (real execution).

The two paths compute the same function (softmax(q kᵀ · scale + causal mask) v). To execute a graph
traced on meta on real CPU tensors (tests, single-process checks), :func:`flash_attention_forward`
and :func:`flash_attention_backward` implement the flash op and its backward from their definition
(logsumexp form), independently of ``F.scaled_dot_product_attention``; the tests compare the two.

With ``context_parallel=True`` in a model's config its attention is the ``local_map`` region
:class:`ContextParallelAttention`, which the planner may shard per mesh axis on the batch, the
heads, or the sequence (context parallelism).

Sliding-window layers (``sliding_window`` in a model's config) run :class:`SlidingWindowAttention`,
a ``local_map`` region sharded on the batch or the heads: each query attends to the ``window`` keys
ending at its own position (Mistral's and Gemma's convention). On real tensors it is
``F.scaled_dot_product_attention`` with that banded mask; traced on meta (for capture and pricing)
it is a kernel of the banded kernel's work (FlashAttention's ``window_size``): every query against
``window`` keys, ``seq x window`` query-key pairs (the first ``window`` queries see fewer: a
``window / (2 seq)`` overcount) where the causal kernel has ``seq² / 2``, and the key/value heads
of grouped-query attention repeated over the window only. ``flex_attention`` would be the native choice, but on torch 2.13 it neither runs on
meta nor has a CPU backward nor a DTensor sharding rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# re-exported: the models' tests check the kernels of the ops the models trace to
from apmodel.core.kernels import (  # noqa: F401
    CPU_REFERENCE_KERNELS,
    HALF_ONLY_KERNELS,
    flash_attention_backward,
    flash_attention_forward,
    rms_norm_backward,
)
from apmodel.graph.regions import LocalRegion, RegionComm, local_map, region_comm

ATTENTION_BACKENDS = ("flash", "efficient")


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "flash"
) -> torch.Tensor:
    """Causal scaled-dot-product attention. ``q, k, v``: ``[batch, heads, seq, head_dim]``.

    ``backend`` picks the aten op used when tracing on meta: ``"flash"`` or ``"efficient"``.
    """
    if q.device.type != "meta":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if backend == "flash":
        # (query, key, value, dropout_p, is_causal, return_debug_mask) -> (output, logsumexp, ...)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
    if backend == "efficient":
        # (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal) -> (output, ...);
        # the logsumexp is needed by the backward op.
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, True
        )[0]
    raise ValueError(f"attention backend {backend!r} is not one of {ATTENTION_BACKENDS}")



@dataclass(frozen=True)
class ContextParallelAttention:
    """Causal attention on local shards ``q [batch, heads, seq, head_dim]`` and ``k, v [batch,
    kv_heads, seq, head_dim]`` (grouped-query: the key/value heads are repeated inside), the
    function of a ``local_map`` region, sharded per mesh axis on the batch, the heads (query and
    key/value heads alike, so each rank keeps whole groups), or the sequence.

    Context parallel: each of ``n`` ranks holds a contiguous chunk of the sequence. Keys and
    values are all-gathered (their gradients reduce-scattered back). Causal load balancing: a
    rank's queries attend to the keys before them, so the last chunk would do ``2n - 1`` times the
    first's work; each rank swaps the second half of its queries with the rank mirrored around
    the middle (``n - 1 - rank``) and swaps the outputs back, so every rank holds one early and
    one late half-chunk and does ``1/n`` of the work (the zig-zag assignment). Each half attends to
    the keys up to its own end with a lower-right causal mask. An odd chunk length has no halves:
    each rank then attends its whole chunk, unbalanced, and is priced as the last rank."""

    backend: str = "flash"

    ALTERNATIVES: ClassVar[dict] = {
        "batch": (("S(0)", "S(0)", "S(0)"), ("S(0)",)),
        "heads": (("S(1)", "S(1)", "S(1)"), ("S(1)",)),
        "context_parallel": (("S(2)", "S(2)", "S(2)"), ("S(2)",)),
    }

    def region(self) -> LocalRegion:
        return local_map(self, name=f"attention_{self.backend}", alternatives=self.ALTERNATIVES)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"attention: {q.shape[1]} local query heads do not group over {k.shape[1]} key/value heads")
        repeat = q.shape[1] // k.shape[1]  # grouped-query attention: each key/value head serves `repeat`
        cp = region_comm("context_parallel")
        if cp.size == 1:
            return causal_attention(q, _repeat_heads(k, repeat), _repeat_heads(v, repeat), self.backend)
        chunk = q.shape[2]
        # gathered before the heads are repeated: n_kv_heads, not n_heads, cross the network
        keys = _repeat_heads(cp.all_gather(k, 2), repeat)
        values = _repeat_heads(cp.all_gather(v, 2), repeat)
        if chunk % 2:  # no halves to swap: unbalanced, priced at the busiest (last) rank
            rank = cp.size - 1 if q.device.type == "meta" else cp.rank
            return self._attend(q, keys, values, rank * chunk)
        half = chunk // 2
        mirror = cp.size - 1 - cp.rank
        early = self._attend(q[:, :, :half], keys, values, cp.rank * chunk)
        late = self._attend(_swap(q[:, :, half:], cp, mirror), keys, values, mirror * chunk + half)
        return torch.cat([early, _swap(late, cp, mirror)], dim=2)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
        """Queries at sequence positions ``start ...`` against every key up to the last of them."""
        end = start + q.shape[2]
        if q.device.type != "meta":
            return F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end],
                                                  attn_mask=causal_lower_right(q.shape[2], end))
        # priced as a flash kernel pair over the same scores: the keys before the block (no mask)
        # and the diagonal block (causal); the sum stands for the log-sum-exp merge
        diagonal = causal_attention(q, keys[:, :, start:end], values[:, :, start:end], self.backend)
        if start == 0:
            return diagonal
        before = torch.ops.aten._scaled_dot_product_flash_attention(q, keys[:, :, :start], values[:, :, :start],
                                                                      0.0, False, False)[0]
        return before + diagonal


def sliding_window_mask(seq: int, window: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[seq, seq]`` bool, True where query ``i`` may attend key ``j``: ``i - window < j <= i``."""
    if window < 1:
        raise ValueError(f"sliding_window_mask: window must be a positive number of keys, got {window}")
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    return (j <= i) & (j > i - window)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                             backend: str = "flash", repeat: int = 1) -> torch.Tensor:
    """Causal attention of each query to the ``window`` keys ending at its position. ``q``: ``[batch,
    heads, seq, head_dim]``; ``k, v``: ``[batch, heads / repeat, seq, head_dim]`` (grouped-query: each
    key/value head serves ``repeat`` query heads). On meta, a stand-in with the banded kernel's work
    and the output's shape (see the module docstring)."""
    seq = q.shape[2]
    if window >= seq:
        return causal_attention(q, _repeat_heads(k, repeat), _repeat_heads(v, repeat), backend)
    if q.device.type != "meta":
        mask = sliding_window_mask(seq, window, q.device)
        return F.scaled_dot_product_attention(q, _repeat_heads(k, repeat), _repeat_heads(v, repeat), attn_mask=mask)
    k, v = _repeat_heads(k[:, :, :window], repeat), _repeat_heads(v[:, :, :window], repeat)
    if backend == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False)[0]
    if backend == "efficient":
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False)[0]
    raise ValueError(f"attention backend {backend!r} is not one of {ATTENTION_BACKENDS}")


@dataclass(frozen=True)
class SlidingWindowAttention:
    """Sliding-window attention on local shards ``q [batch, heads, seq, head_dim]`` and ``k, v
    [batch, kv_heads, seq, head_dim]`` (grouped-query: the key/value heads are repeated inside), the
    function of a ``local_map`` region sharded per mesh axis on the batch or the heads (query and
    key/value heads alike). The sequence is not an alternative: a window crossing a shard's edge
    would need the neighbour's keys."""

    window: int
    backend: str = "flash"

    ALTERNATIVES: ClassVar[dict] = {
        "batch": (("S(0)", "S(0)", "S(0)"), ("S(0)",)),
        "heads": (("S(1)", "S(1)", "S(1)"), ("S(1)",)),
    }

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"SlidingWindowAttention: window must be a positive number of keys, got {self.window}")
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(f"SlidingWindowAttention: backend {self.backend!r} is not one of {ATTENTION_BACKENDS}")

    def region(self) -> LocalRegion:
        return local_map(self, name=f"attention_window{self.window}_{self.backend}", alternatives=self.ALTERNATIVES)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"attention: {q.shape[1]} local query heads do not group over {k.shape[1]} key/value heads")
        return sliding_window_attention(q, k, v, self.window, self.backend, repeat=q.shape[1] // k.shape[1])


def _repeat_heads(x: torch.Tensor, repeat: int) -> torch.Tensor:
    """``[b, kv_heads, s, d] -> [b, kv_heads * repeat, s, d]``, each head ``repeat`` times in a row."""
    if repeat == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, repeat, s, d).reshape(b, h * repeat, s, d)


def _swap(x: torch.Tensor, cp: RegionComm, partner: int) -> torch.Tensor:
    """``x`` sent to rank ``partner`` whose own comes back. An all-to-all, so every rank takes
    part, the middle one of an odd count too (its partner is itself)."""
    rows = [x.shape[0] if j == partner else 0 for j in range(cp.size)]
    return cp.all_to_all(x, rows, rows)
