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

Tested with torchtitan 0.3.0 (:data:`TESTED_VERSION`) on torch 2.13: Llama 3 and DeepSeek-V3
(whose MoE router opens ``torch.autocast`` on its tensors' device, a no-op on meta while capture
traces: :func:`apmodel._torch_private.autocast_skips_meta`).
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

    swaps = ((attention.FlexAttention, "_compiled_flex_attn", flex_attention),
             (attention, "_compiled_create_block_mask", create_block_mask))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    for owner, name, eager in swaps:
        setattr(owner, name, eager)
    try:
        yield
    finally:
        for owner, name, compiled in saved:
            setattr(owner, name, compiled)


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
            masks_of = getattr(self.model, "get_attention_masks", None)  # Decoders with flex or varlen attention
            masks = masks_of(positions) if masks_of is not None else None
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
    embeddings: Any = model.get_submodule("tok_embeddings")
    vocab = int(getattr(model, "vocab_size", 0) or embeddings.num_embeddings)
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


class TrainerModule(nn.Module):
    """What :func:`parallelize_fn` hands torchtitan's trainer: ``module(tokens, positions=,
    attention_masks=)`` on this rank's rows of the batch (torchtitan's dataloader gives each data
    parallel rank its own rows), returning this rank's rows of the logits as a plain tensor
    (differentiable), so the trainer's loss, ``backward`` and optimizer work as with its own
    parallelisms. Inside, every rank's rows are gathered into the global batch the plan was made
    for and run by apmodel's program (``step``, a parallelized :class:`TorchtitanStep`).

    ``attention_masks`` is ignored: the step rebuilds the same masks from ``positions``.
    ``init_weights`` builds the model on the CPU with torchtitan's initialisation, takes rank 0's
    values and loads each rank's shards (the whole model passes through each rank's CPU memory once)."""

    def __init__(self, step: nn.Module, config: Any, mesh: Any) -> None:
        super().__init__()
        self.step = step
        self._config = config  # torchtitan's model config: init_weights builds a fresh model from it
        self._mesh = mesh

    def get_attention_masks(self, positions: torch.Tensor, **_: Any) -> None:
        """None: the masks are built inside the step, from the positions it is given."""
        return None

    def init_weights(self, buffer_device: torch.device | None = None, **_: Any) -> None:
        import torch.distributed as dist

        from apmodel.lowering import load_full_state_dict

        with torch.device("cpu"):
            fresh = self._config.build()
        fresh.init_weights(buffer_device=torch.device("cpu"))
        full = {f"model.{k}": v.detach() for k, v in list(fresh.named_parameters()) + list(fresh.named_buffers())}
        for value in full.values():  # rank 0's initialisation everywhere (ranks may seed differently)
            dist.broadcast(value, src=0)
        load_full_state_dict(self.step, full)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                attention_masks: Any = None) -> torch.Tensor:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Shard

        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        world = dist.get_world_size()
        rows = []
        for local in (tokens, positions.expand_as(tokens).contiguous()):
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local.contiguous())
            rows.append(torch.cat(parts))
        logits = self.step(*rows)
        if isinstance(logits, DTensor):  # this rank's rows: the world's ranks in mesh order (checked when built)
            return logits.redistribute(self._mesh, [Shard(0)] * self._mesh.ndim).to_local()
        return logits.chunk(world)[dist.get_rank()]


def _ac_policy(ac_config: Any) -> str:
    """torchtitan's activation-checkpointing config as apmodel's ``ac`` option."""
    if ac_config is None:
        return "none"
    kind = type(ac_config).__qualname__.lower()
    for policy in ("selective", "full"):
        if policy in kind:
            return policy
    logger.warning("apmodel: torchtitan activation checkpointing %s has no apmodel policy; planning without it",
                   type(ac_config).__qualname__)
    return "none"


def make_parallelize_fn(mesh_shape: Sequence[int] | None = None, **options: Any) -> Any:
    """A torchtitan ``parallelize_fn`` (see :func:`parallelize_fn`) that plans on a mesh of
    ``mesh_shape`` over the whole world (default: torchtitan's ``world_mesh``) with apmodel
    ``options`` (``device="h100"``...)."""

    def hook(model: nn.Module, *, parallel_dims: Any, training: Any, parallelism: Any, compile_config: Any,
             ac_config: Any, dump_folder: str) -> nn.Module:
        import torch.distributed as dist

        from apmodel.entry.api import parallelize as parallelize_step

        others = [name for name in ("tp", "pp", "cp", "ep") if getattr(parallel_dims, f"{name}_enabled", False)]
        if others:
            raise ValueError(f"apmodel plans every mesh axis itself: torchtitan's {', '.join(others)} are enabled; "
                             "configure data parallelism only (dp_shard = the world size)")
        if getattr(compile_config, "enable", False):
            logger.warning("apmodel: torchtitan's compile config is ignored (apmodel runs its own native program)")
        world = dist.get_world_size()
        if mesh_shape is None:
            mesh = parallel_dims.world_mesh
        else:
            mesh = dist.init_device_mesh(parallel_dims.world_mesh.device_type, tuple(mesh_shape))
        if mesh.mesh.flatten().tolist() != list(range(world)):
            raise ValueError(f"apmodel's torchtitan hook needs a mesh over every rank in order, got {mesh.mesh.tolist()}")
        batch, seq = int(training.local_batch_size) * world, int(training.seq_len)
        tokens, positions, _ = sample_batch(model, batch, seq, documents=1)
        config = model.config
        step = parallelize_step(TorchtitanStep(model), mesh, (tokens, positions), ac=_ac_policy(ac_config), **options)
        return TrainerModule(step, config, mesh)

    return hook


def parallelize_fn(model: nn.Module, *, parallel_dims: Any, training: Any, parallelism: Any, compile_config: Any,
                   ac_config: Any, dump_folder: str) -> nn.Module:
    """torchtitan's ``ModelSpec.parallelize_fn`` hook (the signature of its ``parallelize_llama``):
    apmodel plans ``model`` (on meta) for torchtitan's world mesh at the global batch
    (``training.local_batch_size`` rows per rank, ``training.seq_len`` tokens) and returns a
    :class:`TrainerModule`. Only data parallelism may be enabled in torchtitan's config; its
    compile config is ignored, its activation checkpointing mapped to apmodel's ``ac``."""
    return make_parallelize_fn()(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                 compile_config=compile_config, ac_config=ac_config, dump_folder=dump_folder)
