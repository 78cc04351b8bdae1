"""Causal attention shared by the reference models (the CPU reference kernels of the ops it traces
to live in :mod:`apmodel.kernels`).

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

import torch
import torch.nn.functional as F

# re-exported: the models' tests check the kernels of the ops the models trace to
from apmodel.kernels import (  # noqa: F401
    CPU_REFERENCE_KERNELS,
    HALF_ONLY_KERNELS,
    flash_attention_backward,
    flash_attention_forward,
    rms_norm_backward,
)

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

