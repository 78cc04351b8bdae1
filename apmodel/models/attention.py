"""Causal attention shared by the reference models, and CPU reference kernels (flash attention,
fused RMSNorm backward) for ops that the models trace to on meta but that have no CPU kernel.

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
"""

from __future__ import annotations

import math
from types import MappingProxyType

import torch
import torch.nn.functional as F

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


def _causal_scores(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    s_q, s_k = q.shape[-2], k.shape[-2]
    # causal mask aligned to the top-left corner, as is_causal=True in PyTorch's SDPA
    future = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(future, float("-inf"))


def flash_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple:
    """Reference for ``aten._scaled_dot_product_flash_attention`` (same outputs, dropout 0 only)."""
    if dropout_p != 0.0:
        raise ValueError("flash_attention_forward: dropout_p must be 0 in the reference kernel")
    if is_causal:
        scores = _causal_scores(q, k, scale)
    else:
        s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        scores = torch.matmul(q, k.transpose(-2, -1)) * s
    lse = torch.logsumexp(scores, dim=-1)  # [b, h, s_q]
    # the output takes the strides of the query, as the real kernel (and its meta function) does:
    # a traced graph may `view` it in ways that only these strides allow
    out = torch.empty_like(q).copy_(torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v))
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.zeros((), dtype=torch.uint64, device=q.device)
    debug_mask = q.new_empty(0)
    # cum_seq_q / cum_seq_k are undefined for dense (non-nested) inputs, as in the real kernel
    return (out, lse, None, None, q.shape[-2], k.shape[-2], rng_state, unused, debug_mask)


def flash_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p: float,
    is_causal: bool,
    philox_seed,
    philox_offset,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference for ``aten._scaled_dot_product_flash_attention_backward`` (analytic gradient)."""
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = _causal_scores(q, k, s) if is_causal else torch.matmul(q, k.transpose(-2, -1)) * s
    p = torch.exp(scores - logsumexp.unsqueeze(-1))  # attention probabilities
    grad_v = torch.matmul(p.transpose(-2, -1), grad_out)
    grad_p = torch.matmul(grad_out, v.transpose(-2, -1))
    row = (grad_out * out).sum(dim=-1, keepdim=True)  # = sum_j p_ij grad_p_ij
    grad_scores = p * (grad_p - row)
    grad_q = torch.matmul(grad_scores, k) * s
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), q) * s
    # gradients take the strides of their inputs, as the real kernel does
    return tuple(torch.empty_like(x).copy_(g) for x, g in ((q, grad_q), (k, grad_k), (v, grad_v)))


def rms_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    normalized_shape: list[int],
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    output_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Reference for ``aten._fused_rms_norm_backward`` (the backward ``F.rms_norm`` traces to; no CPU
    kernel in torch 2.13). ``rstd = 1 / sqrt(mean(x², normalized dims) + eps)``, kept dims.

    With ``x̂ = x · rstd`` and ``g = grad_out · weight``:
    ``grad_x = rstd · (g − x̂ · mean(g · x̂))`` over the normalized dims, ``grad_w = Σ grad_out · x̂``
    over the leading dims.
    """
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    x_hat = x * rstd
    g = grad_out if weight is None else grad_out * weight
    grad_x = rstd * (g - x_hat * (g * x_hat).mean(dim=dims, keepdim=True)) if output_mask[0] else None
    grad_w = None
    if weight is not None and output_mask[1]:
        grad_w = (grad_out * x_hat).sum(dim=tuple(range(x.dim() - len(normalized_shape))))
    return grad_x, grad_w


# Ops that the reference models trace to on meta but that have no CPU kernel in torch 2.13, mapped
# to the reference implementations above (used to run a graph traced on meta on real CPU tensors).
CPU_REFERENCE_KERNELS = MappingProxyType({
    torch.ops.aten._scaled_dot_product_flash_attention.default: flash_attention_forward,
    torch.ops.aten._scaled_dot_product_flash_attention_backward.default: flash_attention_backward,
    torch.ops.aten._fused_rms_norm_backward.default: rms_norm_backward,
})


def _half_or_reference(op: torch._ops.OpOverload, reference):
    """``op`` for fp16 / bf16 inputs, ``reference`` otherwise (flash attention's CUDA kernel
    refuses fp32: "FlashAttention only support fp16 and bf16 data type")."""

    def run(*args, **kwargs):
        first = next(a for a in args if isinstance(a, torch.Tensor))
        if first.dtype in (torch.float16, torch.bfloat16):
            return op(*args, **kwargs)
        return reference(*args, **kwargs)

    return run


# Ops whose device kernel takes only half precision, mapped to a dispatcher that runs the
# reference implementation for other dtypes (fp32 models lowered on CUDA).
HALF_ONLY_KERNELS = MappingProxyType({
    op: _half_or_reference(op, CPU_REFERENCE_KERNELS[op])
    for op in (
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
    )
})
