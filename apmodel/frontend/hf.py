"""Hugging Face transformers as workloads: ``hf:`` model specs, built from config classes on meta.

``apmodel plan --model hf:gpt2-medium`` (and :func:`apmodel.frontend.workloads.load_workload`) builds the
model from its ``transformers`` configuration class on the meta device: no weights are loaded and
nothing is fetched (``HF_HUB_OFFLINE`` is set before transformers is imported, and configurations
are constructed in code from the published sizes, :data:`PRESETS`, or read from a local
``config.json``: ``hf:/path/to/config.json``). The step planned is the model's own loss:

* causal LM (GPT-2, LLaMA, Pythia/GPT-NeoX, OPT...): ``model(input_ids, labels=labels).loss``,
  labels being the input ids (the model shifts them itself);
* masked LM (BERT, RoBERTa, DistilBERT): the same call on a ``*ForMaskedLM`` head (the loss over
  every position: which tokens are masked is data, the shapes and costs are those of a masked-LM step).

``--layers`` sets ``num_hidden_layers``; ``--seq`` is capped at a learned position table's size
(GPT-2's 1024, BERT's 512: a warning says so), not for rotary models; ``--batch`` is the global batch.

How the model is built, and why:

* **Training configuration**: ``use_cache=False`` (a key/value cache is for generation and builds
  tensors outside the trace) and every dropout and layer-drop probability of the config set to 0
  (the lowered module then trains exactly like one device; dropout's cost is small next to the
  matmuls). transformers before 5.23 draws OPT's layer-drop number even at probability 0, a
  random branch a trace cannot take: capture names it.
* **Attention**: models on transformers' attention interface run HF's own SDPA attention under the
  name :data:`ATTENTION`, whose mask function (:func:`_sdpa_mask_without_packing`) returns no mask
  when the step has no padding mask, no cache and no extra mask pattern, so SDPA runs causal (or
  bidirectional) flash attention, as eager HF does on a GPU. HF decides that in eager with a host
  check of its position ids for packed sequences (``.all()``), which a trace cannot make; under
  tracing (:func:`apmodel._torch_private.library_sees_tracing`) HF instead materialises a
  ``[b, 1, s, s]`` mask built from the position ids, a math-path attention that is exact for any
  positions. This step computes its position ids itself (``arange``): the workload has no input
  that could pack or pad sequences, so the mask is the plain causal one. Other models
  (``_supports_attention_backend`` False) use ``"sdpa"`` or ``"eager"``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch
    from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["ATTENTION", "HF_PREFIX", "HFPreset", "HFSpecError", "HFStep", "HFUnavailable", "PRESETS", "build",
           "config_from_spec", "hf_loss", "is_hf_spec", "position_limit", "step_of", "training_step",
           "transformers_available"]

HF_PREFIX = "hf:"
#: Name under which HF's SDPA attention is registered with the mask function of this module.
ATTENTION = "apmodel_sdpa"

#: Heads a model gets: the loss of ``model(input_ids, labels=...)``; an encoder-decoder
#: (``seq2seq``, T5) feeds the decoder the labels shifted right, as its forward does.
HEADS = ("causal", "masked", "seq2seq")


class HFSpecError(ValueError):
    """An ``hf:`` spec cannot be built; the message names the spec (``load_workload`` raises it as
    a :class:`~apmodel.frontend.workloads.WorkloadError`)."""


class HFUnavailable(HFSpecError):
    """An ``hf:`` spec was given but transformers cannot be imported."""


@dataclass(frozen=True)
class HFPreset:
    """A Hugging Face model by its published sizes: ``model_type`` (the transformers config class
    of ``AutoConfig.for_model``), the config fields that differ from that class's defaults, the
    head (``causal`` or ``masked`` LM) and the parameter count (for tables)."""

    model_type: str
    sizes: Mapping[str, Any] = field(default_factory=dict)
    head: str = "causal"
    params: str = ""
    hub_name: str = ""


#: Published sizes (the models' ``config.json`` on the Hub), constructed in code.
PRESETS: dict[str, HFPreset] = {
    "gpt2": HFPreset("gpt2", dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257),
                     params="124M", hub_name="openai-community/gpt2"),
    "gpt2-medium": HFPreset("gpt2", dict(n_layer=24, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257),
                            params="355M", hub_name="openai-community/gpt2-medium"),
    "gpt2-large": HFPreset("gpt2", dict(n_layer=36, n_embd=1280, n_head=20, n_positions=1024, vocab_size=50257),
                           params="774M", hub_name="openai-community/gpt2-large"),
    "gpt2-xl": HFPreset("gpt2", dict(n_layer=48, n_embd=1600, n_head=25, n_positions=1024, vocab_size=50257),
                        params="1.6B", hub_name="openai-community/gpt2-xl"),
    "bert-base": HFPreset("bert", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                                       intermediate_size=3072, vocab_size=30522, max_position_embeddings=512,
                                       type_vocab_size=2), head="masked", params="110M",
                          hub_name="google-bert/bert-base-uncased"),
    "bert-large": HFPreset("bert", dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16,
                                        intermediate_size=4096, vocab_size=30522, max_position_embeddings=512,
                                        type_vocab_size=2), head="masked", params="336M",
                           hub_name="google-bert/bert-large-uncased"),
    "roberta-base": HFPreset("roberta", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                                             intermediate_size=3072, vocab_size=50265, max_position_embeddings=514,
                                             type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2),
                             head="masked", params="125M", hub_name="FacebookAI/roberta-base"),
    "distilbert-base": HFPreset("distilbert", dict(n_layers=6, dim=768, n_heads=12, hidden_dim=3072, vocab_size=30522,
                                                   max_position_embeddings=512), head="masked", params="67M",
                                hub_name="distilbert/distilbert-base-uncased"),
    "tinyllama-1.1b": HFPreset("llama", dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632,
                                             num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                             max_position_embeddings=2048, rms_norm_eps=1e-5,
                                             tie_word_embeddings=False),
                               params="1.1B", hub_name="TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T"),
    "llama-2-7b": HFPreset("llama", dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008,
                                         num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                         max_position_embeddings=4096, rms_norm_eps=1e-5,
                                         tie_word_embeddings=False),
                           params="6.7B", hub_name="meta-llama/Llama-2-7b-hf"),
    "pythia-160m": HFPreset("gpt_neox", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                                             intermediate_size=3072, vocab_size=50304, max_position_embeddings=2048,
                                             rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False),
                            params="162M", hub_name="EleutherAI/pythia-160m"),
    "pythia-6.9b": HFPreset("gpt_neox", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                                             intermediate_size=16384, vocab_size=50432, max_position_embeddings=2048,
                                             rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False),
                            params="6.9B", hub_name="EleutherAI/pythia-6.9b"),
    "opt-125m": HFPreset("opt", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, ffn_dim=3072,
                                     vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=768),
                         params="125M", hub_name="facebook/opt-125m"),
    "opt-1.3b": HFPreset("opt", dict(num_hidden_layers=24, hidden_size=2048, num_attention_heads=32, ffn_dim=8192,
                                     vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=2048),
                         params="1.3B", hub_name="facebook/opt-1.3b"),
    # --- the rest of the paper's Table 5 ---
    "bloom-560m": HFPreset("bloom", dict(n_layer=24, hidden_size=1024, n_head=16, vocab_size=250880),
                           params="559M", hub_name="bigscience/bloom-560m"),
    "bloom-7b1": HFPreset("bloom", dict(n_layer=30, hidden_size=4096, n_head=32, vocab_size=250880),
                          params="7.1B", hub_name="bigscience/bloom-7b1"),
    "stablelm-2-1.6b": HFPreset("stablelm", dict(num_hidden_layers=24, hidden_size=2048, intermediate_size=5632,
                                                 num_attention_heads=32, num_key_value_heads=32, vocab_size=100352,
                                                 max_position_embeddings=4096, partial_rotary_factor=0.25,
                                                 use_qkv_bias=True, layer_norm_eps=1e-5, tie_word_embeddings=False),
                                params="1.6B", hub_name="stabilityai/stablelm-2-1_6b"),
    "phi-1": HFPreset("phi", dict(num_hidden_layers=24, hidden_size=2048, intermediate_size=8192,
                                  num_attention_heads=32, vocab_size=51200, max_position_embeddings=2048,
                                  partial_rotary_factor=0.5, layer_norm_eps=1e-5, tie_word_embeddings=False),
                      params="1.4B", hub_name="microsoft/phi-1"),
    "phi-2": HFPreset("phi", dict(num_hidden_layers=32, hidden_size=2560, intermediate_size=10240,
                                  num_attention_heads=32, vocab_size=51200, max_position_embeddings=2048,
                                  partial_rotary_factor=0.4, layer_norm_eps=1e-5, tie_word_embeddings=False),
                      params="2.8B", hub_name="microsoft/phi-2"),
    "gpt-neo-2.7b": HFPreset("gpt_neo", dict(num_layers=32, hidden_size=2560, num_heads=20, vocab_size=50257,
                                             max_position_embeddings=2048, window_size=256,
                                             attention_types=[[["global", "local"], 16]]),
                             params="2.7B", hub_name="EleutherAI/gpt-neo-2.7B"),
    "falcon-7b": HFPreset("falcon", dict(num_hidden_layers=32, hidden_size=4544, num_attention_heads=71,
                                         vocab_size=65024, multi_query=True, parallel_attn=True, bias=False,
                                         new_decoder_architecture=False, alibi=False),
                          params="6.9B", hub_name="tiiuae/falcon-7b"),
    "gpt-j-6b": HFPreset("gptj", dict(n_layer=28, n_embd=4096, n_head=16, n_positions=2048, rotary_dim=64,
                                      vocab_size=50400, tie_word_embeddings=False),
                         params="6.1B", hub_name="EleutherAI/gpt-j-6b"),
    "t5-small": HFPreset("t5", dict(num_layers=6, num_decoder_layers=6, d_model=512, d_ff=2048, d_kv=64, num_heads=8,
                                    vocab_size=32128, feed_forward_proj="relu", decoder_start_token_id=0,
                                    pad_token_id=0, eos_token_id=1),
                         head="seq2seq", params="61M", hub_name="google-t5/t5-small"),
    "t5-base": HFPreset("t5", dict(num_layers=12, num_decoder_layers=12, d_model=768, d_ff=3072, d_kv=64, num_heads=12,
                                   vocab_size=32128, feed_forward_proj="relu", decoder_start_token_id=0,
                                   pad_token_id=0, eos_token_id=1),
                        head="seq2seq", params="223M", hub_name="google-t5/t5-base"),
}


# ------------------------------------------------------------------------------ transformers
def transformers_available() -> bool:
    """Whether ``transformers`` imports (the optional dependency ``pip install -e '.[hf]'``)."""
    try:
        _transformers()
    except HFUnavailable:
        return False
    return True


def _transformers() -> Any:
    """The transformers module, offline, with :data:`ATTENTION` registered."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs are built in code or read from a file
    try:
        import transformers
    except Exception as e:  # ImportError, or a broken install
        raise HFUnavailable(f"Hugging Face models need the optional dependency transformers ({type(e).__name__}: {e}); "
                            "install it with pip install -e '.[hf]'") from None
    _register_attention(transformers)
    return transformers


def _register_attention(transformers: Any) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    if ATTENTION not in transformers.AttentionInterface._global_mapping:
        transformers.AttentionInterface.register(ATTENTION, sdpa_attention_forward)
    if ATTENTION not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(ATTENTION, _sdpa_mask_without_packing)


def _sdpa_mask_without_packing(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    **kwargs: Any,
) -> torch.Tensor | None:
    """HF's ``sdpa_mask``, except that a step without padding mask, cache offsets, local window or
    extra mask pattern gets no mask (SDPA's ``is_causal`` for causal attention, nothing for
    bidirectional): see the module docstring. Anything else is HF's own mask."""
    from transformers.masking_utils import sdpa_mask

    plain = (attention_mask is None and local_size is None and not use_vmap and q_length == kv_length
             and isinstance(q_offset, int) and not q_offset and not kv_offset)
    if plain:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=allow_is_causal_skip,
                     allow_is_bidirectional_skip=allow_is_bidirectional_skip, use_vmap=use_vmap, **kwargs)


# ------------------------------------------------------------------------------ specs
def is_hf_spec(spec: str) -> bool:
    return spec.startswith(HF_PREFIX)


def _looks_like_path(name: str) -> bool:
    return name.endswith(".json") or os.sep in name or name.startswith(".") or Path(name).is_dir()


def config_from_spec(spec: str) -> tuple[Any, str]:
    """``(transformers config, head)`` of ``hf:NAME`` (a :data:`PRESETS` name) or
    ``hf:/path/to/config.json`` (a local file, or a directory holding ``config.json``).

    Raises :class:`HFSpecError` naming the spec: an unknown name, a missing or
    unreadable file, a ``model_type`` transformers does not know."""
    if not is_hf_spec(spec):
        raise HFSpecError(f"model {spec!r}: not an hf: spec (hf:NAME or hf:/path/to/config.json)")
    name = spec[len(HF_PREFIX):].strip()
    if not name:
        raise HFSpecError(f"model {spec!r}: give a model after hf:, one of {', '.join(PRESETS)} "
                          "or a path to a config.json")
    try:
        transformers = _transformers()
    except HFUnavailable as e:
        raise HFUnavailable(f"model {spec!r}: {e}") from None
    if name in PRESETS:
        preset = PRESETS[name]
        return transformers.AutoConfig.for_model(preset.model_type, **dict(preset.sizes)), preset.head
    if not _looks_like_path(name):
        raise HFSpecError(f"model {spec!r}: unknown Hugging Face model {name!r}; known: {', '.join(PRESETS)}; "
                          "or hf:/path/to/config.json")
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise HFSpecError(f"model {spec!r}: config file {str(path)!r} does not exist")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HFSpecError(f"model {spec!r}: cannot read config file {str(path)!r}: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise HFSpecError(f"model {spec!r}: config file {str(path)!r} has no \"model_type\" string")
    model_type = raw.pop("model_type")
    try:
        config = transformers.AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError, TypeError) as e:
        logger.info("transformers' whole message for %s: %s", spec, e)
        raise HFSpecError(f"model {spec!r}: config file {str(path)!r}: transformers "
                          f"{transformers.__version__} cannot build model_type {model_type!r} "
                          f"({_first_sentence(str(e))}; -v shows transformers' whole message)") from None
    return config, _head_of(config, spec)


def _head_of(config: Any, spec: str) -> str:
    """``masked`` or ``causal``: from the config's ``architectures`` when it names one; else masked
    when the model type has a masked-LM class (an encoder, BERT-like) unless the config says
    ``is_decoder``; else causal."""
    from transformers.models.auto import modeling_auto

    causal = config.model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    masked = config.model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if getattr(config, "is_encoder_decoder", False) and \
            config.model_type in modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "seq2seq"
    for arch in getattr(config, "architectures", None) or []:
        if arch.endswith("ForMaskedLM") and masked:
            return "masked"
        if (arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel")) and causal:
            return "causal"
    if masked and not (causal and getattr(config, "is_decoder", False)):
        return "masked"
    if causal:
        return "causal"
    raise HFSpecError(f"model {spec!r}: model_type {config.model_type!r} has no causal-LM, masked-LM or "
                      "sequence-to-sequence LM head in transformers (only language models are supported)")


# ------------------------------------------------------------------------------ building
def _training_config(config: Any, layers: int | None) -> Any:
    """The config as trained here: no cache, no dropout, ``layers`` layers (see the module docstring)."""
    config = config.__class__.from_dict(config.to_dict())  # a copy: the caller's config is left alone
    config.use_cache = False
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and "drop" in key:  # dropout, *_pdrop, layerdrop: no random draws
            setattr(config, key, 0.0)
    if layers is not None:
        if layers < 1:
            raise HFSpecError(f"layers must be positive, got {layers}")
        config.num_hidden_layers = layers
        if getattr(config, "num_decoder_layers", None) is not None:  # an encoder-decoder: both stacks
            config.num_decoder_layers = layers
        types = getattr(config, "layer_types", None)
        if isinstance(types, list) and len(types) != layers:
            config.layer_types = (types * layers)[:layers]
    return config


def _model_class(transformers: Any, config: Any, head: str) -> Any:
    from transformers.models.auto import modeling_auto

    names = {"causal": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
             "masked": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
             "seq2seq": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES}[head]
    name = names.get(config.model_type)
    if name is None or not hasattr(transformers, name):
        raise HFSpecError(f"model_type {config.model_type!r} has no {head}-LM class in transformers "
                          f"{transformers.__version__}")
    return getattr(transformers, name)


def _attention_for(cls: Any) -> str:
    if getattr(cls, "_supports_attention_backend", False):
        return ATTENTION
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def build(config: Any, head: str = "causal", *, layers: int | None = None) -> nn.Module:
    """The model of a transformers ``config`` with a ``head`` (``causal`` or ``masked`` LM), as
    trained here (:func:`_training_config`), built where the caller's default device says (use
    ``with torch.device("meta")``: no memory is allocated). ``config`` may also be an ``hf:`` spec."""
    import torch

    transformers = _transformers()
    if isinstance(config, str):
        config, head = config_from_spec(config)
    if head not in HEADS:
        raise HFSpecError(f"head {head!r}: expected one of {HEADS}")
    config = _training_config(config, layers)
    cls = _model_class(transformers, config, head)
    config._attn_implementation = _attention_for(cls)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    if getattr(model, "loss_type", "") is None:  # a class name HF cannot map to a loss (GPT2LMHeadModel)
        model.loss_type = "ForCausalLM" if head == "causal" else "ForMaskedLM"  # what it falls back to, said
    model.train()
    return model


def position_limit(model: nn.Module) -> int | None:
    """The longest sequence a model's learned position table takes (GPT-2: 1024, BERT: 512,
    RoBERTa: 512 of its 514 rows; GPT-J: its precomputed rotary table's 2048), None for a model
    without one (rotary positions computed on the fly).

    A position table is an ``nn.Embedding`` whose module name says ``pos`` (``wpe``,
    ``position_embeddings``, ``embed_positions``); rows below ``padding_idx + 1`` (RoBERTa counts
    positions from there) and an ``offset`` attribute (OPT's 2) are not usable."""
    from torch import nn

    limits = []
    for name, mod in model.named_modules():
        last = name.rsplit(".", 1)[-1].lower()
        if isinstance(mod, nn.Embedding) and ("pos" in last or last == "wpe"):
            rows = mod.num_embeddings - int(getattr(mod, "offset", 0) or 0)
            if mod.padding_idx is not None:
                rows -= int(mod.padding_idx) + 1
            limits.append(rows)
    for name, buf in model.named_buffers():
        # a precomputed rotary table (GPT-J's ``embed_positions``: one row per position)
        if name.rsplit(".", 1)[-1] == "embed_positions" and buf.dim() == 2:
            limits.append(int(buf.shape[0]))
    return min(limits) if limits else None


def hf_loss(output: Any, *inputs: Any) -> torch.Tensor:
    """The loss a transformers model computed from its ``labels`` (``output.loss``)."""
    loss = getattr(output, "loss", None)
    if loss is None:
        raise ValueError("the Hugging Face model returned no loss: call it with labels=")
    return loss


@dataclass
class HFStep:
    """One training step of a transformers LM: ``loss_fn(model(*sample_inputs, **kwargs))``, i.e.
    ``model(input_ids, labels=labels).loss``; ``seq`` is the sequence length used."""

    model: nn.Module
    sample_inputs: tuple[torch.Tensor, ...]
    kwargs: dict[str, torch.Tensor]
    seq: int
    loss_fn: Any = hf_loss


def step_of(model: nn.Module, *, batch: int, seq: int, name: str = "") -> HFStep:
    """The training step of a transformers LM on meta ``[batch, seq]`` token ids (``seq`` capped
    at :func:`position_limit`, with a warning); labels are a second ``[batch, seq]`` tensor."""
    import torch

    limit = position_limit(model)
    if limit is not None and seq > limit:
        logger.warning("%s: sequence %d is longer than its position table; planned at its limit, %d",
                       name or type(model).__name__, seq, limit)
        seq = limit
    if batch < 1 or seq < 1:
        raise HFSpecError(f"batch and seq must be positive, got batch {batch}, seq {seq}")
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    labels = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return HFStep(model, (ids,), {"labels": labels}, seq)


def training_step(spec: str, *, batch: int, seq: int, layers: int | None = None) -> HFStep:
    """The training step of an ``hf:`` spec (see the module docstring), built on the meta device."""
    import torch

    config, head = config_from_spec(spec)
    with torch.device("meta"):
        model = build(config, head, layers=layers)
    # torch's stub types every Module attribute Tensor | Module; config is a transformers config
    logger.info("%s: %s (%s LM, %d layers, attention %s)", spec, type(model).__name__, head,
                model.config.num_hidden_layers, model.config._attn_implementation)  # type: ignore[union-attr]
    return step_of(model, batch=batch, seq=seq, name=spec)


def _first_sentence(text: str, limit: int = 200) -> str:
    """The start of a library's message (transformers lists every model type it knows: 12,000
    characters), cut at the first sentence or ``limit`` characters."""
    head = text.strip().split(". ")[0].split("\n")[0]
    return head if len(head) <= limit else head[:limit - 3] + "..."
