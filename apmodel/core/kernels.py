"""Local kernels for ops a traced graph uses but a device cannot run, for the lowered program.

The planner traces attention as ``aten._scaled_dot_product_flash_attention`` (it has DTensor
sharding rules, and :func:`apmodel._torch_private.fused_attention_on_meta` makes every
``F.scaled_dot_product_attention`` trace to it) and RMSNorm's backward as
``aten._fused_rms_norm_backward``. Measured on torch 2.13.0+cpu, neither has a CPU kernel
("Could not run ... with arguments from the 'CPU' backend"), and flash attention's CUDA kernel takes
only fp16 and bf16. :func:`flash_attention_forward`, :func:`flash_attention_backward` and
:func:`rms_norm_backward` implement them from their definitions (logsumexp form), independently of
``F.scaled_dot_product_attention``; the tests compare the two. On CPU the lowered program runs
attention through PyTorch's fused CPU flash kernel instead (:func:`cpu_flash_attention_forward`,
what eager PyTorch runs there). :func:`local_kernels` is what :func:`apmodel.entry.api.parallelize`
hands the lowering for a device.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Callable

import torch


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
    return torch.empty_like(q).copy_(grad_q), torch.empty_like(k).copy_(grad_k), torch.empty_like(v).copy_(grad_v)


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


# Ops that traced graphs use but that have no CPU kernel in torch 2.13, mapped to the reference
# implementations above (used to run a graph traced on meta on real CPU tensors).
CPU_REFERENCE_KERNELS: MappingProxyType[Any, Callable[..., Any]] = MappingProxyType({
    torch.ops.aten._scaled_dot_product_flash_attention.default: flash_attention_forward,
    torch.ops.aten._scaled_dot_product_flash_attention_backward.default: flash_attention_backward,
    torch.ops.aten._fused_rms_norm_backward.default: rms_norm_backward,
})


def cpu_flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                                is_causal: bool = False, return_debug_mask: bool = False, *,
                                scale: float | None = None) -> tuple:
    """``aten._scaled_dot_product_flash_attention`` on CPU through PyTorch's fused CPU kernel
    (``_scaled_dot_product_flash_attention_for_cpu``, what ``F.scaled_dot_product_attention`` runs
    on CPU): the outputs of :func:`flash_attention_forward`, computed as eager PyTorch does."""
    if dropout_p != 0.0:
        raise ValueError("cpu_flash_attention_forward: dropout_p must be 0")
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.zeros((), dtype=torch.uint64, device=q.device)
    # the output with the query's strides and a contiguous logsumexp, as the CUDA kernel's meta gives
    return (torch.empty_like(q).copy_(out), lse.contiguous(), None, None, q.shape[-2], k.shape[-2], rng_state,
            unused, q.new_empty(0))


def cpu_flash_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, logsumexp: torch.Tensor, cum_seq_q, cum_seq_k, max_q, max_k,
                                 dropout_p: float, is_causal: bool, philox_seed, philox_offset, *,
                                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten._scaled_dot_product_flash_attention_backward`` through the fused CPU kernel."""
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, logsumexp, 0.0, is_causal, scale=scale)
    return torch.empty_like(q).copy_(grads[0]), torch.empty_like(k).copy_(grads[1]), torch.empty_like(v).copy_(grads[2])


# What the lowered program runs on CPU: PyTorch's fused CPU flash attention (the kernel eager
# PyTorch uses there), the reference RMSNorm backward (no CPU kernel in torch 2.13).
CPU_KERNELS: MappingProxyType[Any, Callable[..., Any]] = MappingProxyType({
    **CPU_REFERENCE_KERNELS,
    torch.ops.aten._scaled_dot_product_flash_attention.default: cpu_flash_attention_forward,
    torch.ops.aten._scaled_dot_product_flash_attention_backward.default: cpu_flash_attention_backward,
})


def _half_or_reference(op: Any, reference: Callable[..., Any]) -> Callable[..., Any]:
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
HALF_ONLY_KERNELS: MappingProxyType[Any, Callable[..., Any]] = MappingProxyType({
    op: _half_or_reference(op, CPU_REFERENCE_KERNELS[op])
    for op in (
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
    )
})


def local_kernels(device: torch.device) -> dict[Any, Callable[..., Any]]:
    """Replacement kernels the lowered program runs on local shards on ``device``: on CPU the fused
    CPU flash attention and the reference RMSNorm backward; on CUDA the real kernel for half
    precision and the reference for fp32 (same outputs, same logsumexp, so the traced backward op
    pairs with either)."""
    if device.type == "cpu":
        return dict(CPU_KERNELS)
    if device.type == "cuda":
        return dict(HALF_ONLY_KERNELS)
    return {}
