"""torchtitan's models planned and run by apmodel (the optional extra ``pip install -e '.[torchtitan]'``).

torchtitan's language models (``torchtitan.models.llama3`` and the others built on its
``Decoder``) attend through ``flex_attention`` with a block mask that ``get_attention_masks``
builds from per-document ``positions`` (causal within each packed document). apmodel captures
those calls (:mod:`apmodel.graph.flex`); this module supplies the rest:

* :class:`TorchtitanStep`: a decoder called as torchtitan's trainer calls it, the masks built
  inside ``forward`` from ``positions`` (so capture traces them and every step masks its own
  documents), with torchtitan's compiled ``flex_attention`` and ``create_block_mask`` swapped for
  torch's eager functions while it runs (:func:`eager_flex_attention`);
* :func:`build_model`, :func:`sample_batch`, :func:`plan` and :func:`parallelize`: a model from
  torchtitan's registry (its debug configs included), a batch of tokens, documents and labels,
  and apmodel's plan and module for them;
* :func:`parallelize_fn`: the hook a torchtitan ``ModelSpec`` takes (``parallelize_fn=``), with the
  signature of torchtitan's own ``parallelize_llama``.

Tested with torchtitan 0.3.0 (:data:`TESTED_VERSION`) on torch 2.13. DeepSeek-V3's MoE opens
``torch.autocast(device_type=x.device.type)``, which refuses the meta device capture traces on
(``RuntimeError: User specified an unsupported autocast device_type 'meta'``): it is not planned.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from apmodel.result.plans import Plan

logger = logging.getLogger(__name__)

TESTED_VERSION = "0.3.0"
INSTALL = "pip install -e '.[torchtitan]'"


def require_torchtitan() -> Any:
    """The ``torchtitan`` package, or an ImportError that says how to install it."""
    try:
        return importlib.import_module("torchtitan")
    except ImportError as e:
        raise ImportError(f"apmodel's torchtitan support needs torchtitan {TESTED_VERSION} ({INSTALL}): {e}") from e


@contextlib.contextmanager
def eager_flex_attention() -> Iterator[None]:
    """While inside, torchtitan's attention calls torch's ``flex_attention`` and
    ``create_block_mask`` instead of the ``torch.compile`` d copies it makes at import (the
    ``FlexAttention._compiled_flex_attn`` class attribute and the module global
    ``_compiled_create_block_mask``): apmodel's capture routes the eager function, and on CPU
    the eager function runs forward-only without a compiler. Restored on exit."""
    attention = importlib.import_module("torchtitan.models.common.attention")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex_cls = attention.FlexAttention
    saved = flex_cls._compiled_flex_attn, attention._compiled_create_block_mask
    flex_cls._compiled_flex_attn = flex_attention
    attention._compiled_create_block_mask = create_block_mask
    try:
        yield
    finally:
        flex_cls._compiled_flex_attn, attention._compiled_create_block_mask = saved


class TorchtitanStep(nn.Module):
    """``model(tokens, positions, model.get_attention_masks(positions))`` -> logits ``[batch, seq,
    vocab]``, the masks built in ``forward`` under :func:`eager_flex_attention`. ``positions``:
    ``[batch, seq]`` integer positions within each packed document (0 starts a document), as
    torchtitan's dataloaders emit them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with eager_flex_attention():
            masks = self.model.get_attention_masks(positions) if hasattr(self.model, "get_attention_masks") else None
            return self.model(tokens, positions, masks)


def build_model(name: str = "llama3", flavor: str = "debugmodel", *, device: str | torch.device = "meta",
                **registry_options: Any) -> nn.Module:
    """torchtitan's ``torchtitan.models.<name>.model_registry(flavor)`` model, built on ``device``
    (meta: nothing allocated; elsewhere its weights initialised by ``init_weights``)."""
    require_torchtitan()
    try:
        registry = importlib.import_module(f"torchtitan.models.{name}").model_registry
    except (ImportError, AttributeError) as e:
        raise ValueError(f"torchtitan has no model family {name!r} with a model_registry ({e})") from e
    config = registry(flavor, **registry_options).model
    with torch.device(device):
        model = config.build()
    if torch.device(device).type != "meta":
        model.init_weights(buffer_device=torch.device(device))
    return model


def sample_batch(model: nn.Module, batch: int, seq: int, *, documents: int = 2,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, positions, labels) on CPU: random tokens of ``model``'s vocabulary, each row
    packing ``documents`` documents of equal length (positions restart at 0), labels the next tokens."""
    vocab = int(getattr(model, "vocab_size", 0) or model.tok_embeddings.num_embeddings)
    if documents < 1 or seq % documents:
        raise ValueError(f"sample_batch: {documents} documents do not split a sequence of {seq} tokens evenly")
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    positions = torch.arange(seq).remainder(seq // documents).repeat(batch, 1)
    return stream[:, :-1].contiguous(), positions, stream[:, 1:].contiguous()


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def plan(model: nn.Module, mesh_shape: Sequence[int], batch: int, seq: int, *, documents: int = 2,
         **options: Any) -> Plan:
    """apmodel's plan of one training step of torchtitan ``model`` (on meta, ideally) at a
    global ``batch`` of ``seq`` tokens packing ``documents`` documents a row; ``options`` as
    :func:`apmodel.plan` takes them (``device="h100"``, ``solver=``...)."""
    from apmodel.entry.api import plan as plan_step

    tokens, positions, labels = sample_batch(model, batch, seq, documents=documents)
    return plan_step(TorchtitanStep(model), mesh_shape, (tokens, positions), loss_fn=cross_entropy,
                     targets=(labels,), **options)


def parallelize(model: nn.Module, mesh: Any, tokens: torch.Tensor, positions: torch.Tensor,
                labels: torch.Tensor, **options: Any) -> nn.Module:
    """:func:`apmodel.parallelize` of one training step of torchtitan ``model`` (on meta,
    ideally) on ``mesh``, for global batches shaped like these: the result is called as
    ``module(tokens, positions, labels)`` and returns the loss (:func:`cross_entropy`)."""
    from apmodel.entry.api import parallelize as parallelize_step

    return parallelize_step(TorchtitanStep(model), mesh, (tokens, positions), loss_fn=cross_entropy,
                            targets=(labels,), **options)
