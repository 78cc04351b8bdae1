"""FlexAttention (``torch.nn.attention.flex_attention``) captured as a parallel region.

On torch 2.13 ``flex_attention`` refuses meta tensors (capture's device), has no CPU backward,
and its higher-order op has no DTensor sharding rule. While a step is traced
(:func:`flex_attention_captured`, entered by capture), a model's unmodified call
``flex_attention(q, k, v, block_mask=...)`` is routed instead to a ``local_map`` region
(:mod:`apmodel.graph.regions`) of four tensors: ``q``, ``k``, ``v`` and the mask as a dense
boolean ``[B, H, q_len, kv_len]`` (``B``, ``H`` the block mask's: 1 where it broadcasts), evaluated
from the block mask's ``mask_mod`` inside the graph (``create_mask``), so a document mask built from
the tokens in ``forward`` is recomputed from each step's tokens. The block mask's block tables are
not read (they only say which blocks a fused kernel may skip; the dense mask says it all).

The planner picks per mesh axis one of (see :class:`FlexAttention`):

* ``batch``: q, k, v and the output sharded on dim 0; the mask too where it varies over the batch
  (a document mask), else whole;
* ``heads``: the same on dim 1 (grouped-query key/value heads split alike, whole groups per rank);
* or everything replicated.

Sequence sharding is not offered: the obvious alternative (queries and the mask's rows on dim 2,
keys and values whole, their gradients partial sums) leaves the ``stack`` that joins a fused
QKV projection's gradients one candidate on torch 2.13, whose rule follows the mixed placements
(``S(2)`` beside ``P``) into an infeasible problem; context parallelism for flex masks needs the
mask's rows and a key/value all-gather, as :class:`apmodel.models.attention.ContextParallelAttention` does.

Priced (traced on meta) as the causal flash kernel at the local shapes: the attention FLOPs of
half the query-key pairs, a documented approximation whatever the mask keeps (a document mask keeps
fewer; no mask keeps all). Run on real tensors as ``F.scaled_dot_product_attention`` with the dense
mask, a query that the mask leaves no key giving zeros (flex_attention's convention); that has a
CPU backward, so CPU processes train it. On a GPU the dense mask costs ``B·H·q_len·kv_len`` bytes
and the fused kernel's block skipping is not used. ``score_mod`` is refused; a logsumexp asked for
(``return_lse``) comes back None.

A BlockMask the user passes in (a sample input or keyword argument) is carried as a graph input
holding its dense mask (:func:`dense_mask`, evaluated on the host every call by
``InputSignature.flatten``); the traced model receives a stand-in (:func:`block_mask_of`) whose
``mask_mod`` (:class:`DenseMaskMod`) the route recognises and reads directly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from apmodel.graph.regions import LocalRegion, local_map


class FlexAttentionError(NotImplementedError):
    """A ``flex_attention`` call apmodel cannot capture; the message says which argument."""


@dataclass(frozen=True)
class FlexAttention:
    """The function of one kind of captured ``flex_attention`` call, on local shards ``q [batch,
    heads, q_len, head_dim]``, ``k, v [batch, kv_heads, kv_len, head_dim]`` and (``masked``) the
    boolean mask ``[batch or 1, heads or 1, q_len, kv_len]``."""

    scale: float
    gqa: bool  # fewer key/value heads than query heads
    masked: bool
    mask_batch: bool  # the mask differs per batch row (its dim 0 is the batch's)
    mask_heads: bool  # the mask differs per head

    def alternatives(self) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
        mask: dict[str, tuple[str, ...]] = {"batch": (), "heads": ()}
        if self.masked:
            mask = {"batch": ("S(0)" if self.mask_batch else "R",), "heads": ("S(1)" if self.mask_heads else "R",)}
        return {
            "batch": (("S(0)", "S(0)", "S(0)", *mask["batch"]), ("S(0)",)),
            "heads": (("S(1)", "S(1)", "S(1)", *mask["heads"]), ("S(1)",)),
        }

    def name(self) -> str:
        flags = "".join(flag for flag, on in (("m", self.masked), ("b", self.mask_batch), ("h", self.mask_heads),
                                              ("g", self.gqa)) if on)
        scale = repr(float(self.scale)).replace(".", "p").replace("-", "m").replace("+", "")
        return f"flex_attention_{flags or 'plain'}_scale{scale}"

    def region(self) -> LocalRegion:
        return local_map(self, name=self.name(), alternatives=self.alternatives(), communicates=False)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"flex_attention: {q.shape[1]} local query heads do not group over "
                             f"{k.shape[1]} key/value heads")
        if q.device.type == "meta":
            return self._priced(q, k, v)
        if not mask:
            return F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=self.gqa)
        keep = mask[0]
        rows = keep.any(dim=-1, keepdim=True)  # queries the mask leaves at least one key
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep | ~rows, scale=self.scale, enable_gqa=self.gqa)
        return out * rows

    def _priced(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """On meta: the causal flash kernel at these shapes (what the compute model prices); query/key
        and value head dims that differ are both priced at the wider."""
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:
            b, h, s, d = k.shape
            k, v = (t[:, :, None].expand(b, h, repeat, s, d).reshape(b, h * repeat, s, d) for t in (k, v))
        width, value_width = q.shape[-1], v.shape[-1]
        if width != value_width:  # the flash kernel takes one head dim: pad to the wider (MLA's values)
            wide = max(width, value_width)
            q, k, v = (F.pad(t, (0, wide - t.shape[-1])) for t in (q, k, v))
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=self.scale)[0]
        return out[..., :value_width] if out.shape[-1] != value_width else out


def _route(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, score_mod: Callable | None,
           mask_mod: Callable | None, mask_shape: tuple[int, int, int, int], scale: float) -> torch.Tensor:
    """A ``flex_attention`` call as the region (see :func:`apmodel._torch_private.flex_attention_routed`)."""
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None:
        raise FlexAttentionError(f"flex_attention with score_mod {getattr(score_mod, '__name__', score_mod)!r}: "
                                 "apmodel captures block masks (mask_mod) only; express it as a mask_mod, or "
                                 "wrap the attention in apmodel.local_map")
    batch, heads, q_len, kv_len = mask_shape
    if isinstance(mask_mod, DenseMaskMod):  # a BlockMask the user passed in: its dense mask is a graph input
        batch, heads = int(mask_mod.mask.shape[0]), int(mask_mod.mask.shape[1])
    fn = FlexAttention(scale=scale, gqa=query.shape[1] != key.shape[1], masked=mask_mod is not None,
                       mask_batch=mask_mod is not None and batch > 1, mask_heads=mask_mod is not None and heads > 1)
    if mask_mod is None:
        return fn.region()(query, key, value)
    if isinstance(mask_mod, DenseMaskMod):
        return fn.region()(query, key, value, mask_mod.mask)
    try:
        mask = create_mask(mask_mod, batch, heads, q_len, kv_len, device=query.device)
    except RuntimeError as e:
        raise FlexAttentionError(
            f"flex_attention's mask_mod {getattr(mask_mod, '__name__', mask_mod)!r} could not be evaluated on "
            f"{query.device} tensors while the step was traced ({str(e).splitlines()[0]}); build the BlockMask "
            "inside forward from the model's inputs (create_block_mask(..., device=tokens.device))") from e
    return fn.region()(query, key, value, mask)


@contextlib.contextmanager
def flex_attention_captured() -> Iterator[None]:
    """While inside, ``flex_attention`` calls run as :class:`FlexAttention` regions."""
    from apmodel._torch_private import flex_attention_routed

    with flex_attention_routed(_route):
        yield



# ---------------------------------------------------------------------------------------------
# BlockMask inputs: carried through the graph as their dense masks
# ---------------------------------------------------------------------------------------------

BLOCK = 128  # tokens a side of the stand-in's blocks (create_block_mask's default); none is skipped


@dataclass(frozen=True, eq=False)
class DenseMaskMod:
    """A ``mask_mod`` reading a dense boolean mask ``[B, H, q_len, kv_len]`` (B, H may be 1): the
    one of the stand-in block mask a traced step receives where the user passed a BlockMask."""

    mask: torch.Tensor

    def __call__(self, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        batch, heads = self.mask.shape[0], self.mask.shape[1]
        return self.mask[b if batch > 1 else 0, h if heads > 1 else 0, q, kv]


def is_block_mask(value: object) -> bool:
    from torch.nn.attention.flex_attention import BlockMask

    return isinstance(value, BlockMask)


def dense_mask(block_mask: Any) -> torch.Tensor:
    """The boolean ``[B, H, q_len, kv_len]`` mask of a BlockMask (B, H its own: 1 where it
    broadcasts), on its device: its ``mask_mod`` evaluated everywhere (``create_mask``)."""
    from torch.nn.attention.flex_attention import create_mask, noop_mask

    mod = block_mask.mask_mod
    if isinstance(mod, DenseMaskMod):
        return mod.mask
    batch, heads = int(block_mask.kv_num_blocks.shape[0]), int(block_mask.kv_num_blocks.shape[1])
    q_len, kv_len = block_mask.seq_lengths
    return create_mask(mod if mod is not None else noop_mask, batch, heads, q_len, kv_len,
                       device=block_mask.kv_num_blocks.device)


def block_mask_of(mask: torch.Tensor) -> Any:
    """A BlockMask standing for the dense ``mask`` inside a traced step: every block partial, its
    ``mask_mod`` a :class:`DenseMaskMod` (which the captured call reads directly)."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, heads, q_len, kv_len = mask.shape
    q_blocks, kv_blocks = -(-q_len // BLOCK), -(-kv_len // BLOCK)
    counts = torch.full((batch, heads, q_blocks), kv_blocks, dtype=torch.int32, device=mask.device)
    indices = torch.arange(kv_blocks, dtype=torch.int32, device=mask.device).expand(batch, heads, q_blocks, kv_blocks)
    return BlockMask.from_kv_blocks(counts, indices.contiguous(), BLOCK_SIZE=BLOCK, mask_mod=DenseMaskMod(mask),
                                    seq_lengths=(q_len, kv_len))


def dense_block_masks(flat: tuple[Any, ...], model: torch.nn.Module) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    """BlockMasks among a call's flat inputs replaced by their dense masks, on the device the step
    is traced on (the model's parameters'); and their positions."""
    at = tuple(i for i, x in enumerate(flat) if is_block_mask(x))
    if not at:
        return flat, ()
    device = next((p.device for p in model.parameters()), None)
    dense = tuple(dense_mask(x).to(device or x.kv_num_blocks.device) if i in at else x for i, x in enumerate(flat))
    return dense, at
