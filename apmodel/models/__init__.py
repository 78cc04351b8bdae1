"""Reference models: LLaMA-3-style dense, DeepSeek-MoE-style, DeepSeek-V3-style, GPT-2-style.

>>> import torch
>>> from apmodel.models import build, sample_inputs, cross_entropy_loss
>>> with torch.device("meta"):
...     model = build("llama3-8b", n_layers=2)
>>> tokens, targets = sample_inputs("llama3-8b", batch=8, seq=2048)

Every model is called as ``model(tokens)`` -> ``logits [batch, seq, vocab]`` or
``model(tokens, targets)`` -> scalar mean cross-entropy loss (so ``capture(model, (tokens, targets))``
needs no ``loss_fn``). Models build on the meta device; ``init_weights()`` fills them after
``to_empty(device=...)``.

Presets (sizes from the published model cards):

==================  =====  ======  =====  =====  ======  =======  =====================================
name                layers  dim    heads  kv     ffn     vocab    notes
==================  =====  ======  =====  =====  ======  =======  =====================================
llama3-debug        2      256     8      4      768     2048     head_dim 32, GQA 2:1, max_seq 512
llama3-8b           32     4096    32     8      14336   128256   rope theta 5e5 (≈ 8.03e9 params)
llama3-70b          80     8192    64     8      28672   128256   rope theta 5e5 (≈ 70.6e9 params)
llama3-405b         126    16384   128    8      53248   128256   Llama 3.1 405B, 128K context (≈ 406e9)
qwen3-32b           64     5120    64     8      25600   151936   head_dim 128, QK-norm (≈ 32.8e9 params)
llama3-8b-cp        32     4096    32     8      14336   128256   llama3-8b, attention the context-parallel
                                                                  region, max_seq 131072 (LLaMA 3.1's)
hybrid-swa-30b      62     5376    32     16     21504   262208   Gemma 3 27B's sizes: sliding window 1024,
                                                                  every 6th layer full, head_dim 128,
                                                                  QK-norm (≈ 28.4e9 params)
hybrid-swa-debug    4      256     8      4      768     2048     window 8, every 2nd layer full
gpt2                12     768     12     12     3072    50257    ctx 1024, untied head (≈ 163M; tied 124M)
gpt2-medium         24     1024    16     16     4096    50257    ctx 1024, untied head (≈ 407M; tied 355M)
moe-debug           2      256     8      4      768     2048     8 routed (top-2) + 1 shared, 128 wide;
                                                                  layer 0 dense
deepseek-moe-16b    28     2048    16     16     10944   102400   64 routed (top-6) + 2 shared, 1408 wide
qwen3-235b-a22b     94     4096    64     4      —       151936   128 routed (top-8, renormalised), 1536
                                                                  wide, no shared; head_dim 128, QK-norm
deepseek-v3         61     7168    128    MLA    18432   129280   MLA (q_lora 1536, kv_lora 512, nope 128,
                                                                  rope 64, v 128); 256 routed (top-8 of 4
                                                                  of 8 groups, sigmoid, scaled 2.5) + 1
                                                                  shared, 2048 wide; 3 dense (≈ 671e9)
deepseek-v3-16b     27     2048    16     MLA    10944   102400   DeepSeek-V2-Lite's sizes (kv_lora 512, no
                                                                  q compression), V3's sigmoid routing;
                                                                  64 routed (top-6) + 2 shared, 1408 wide;
                                                                  max_seq 16384 (≈ 15.7e9)
deepseek-v3-debug   2      256     8      MLA    768     2048     q_lora 64, kv_lora 32, 8 routed (top-2 of
                                                                  2 of 4 groups) + 1 shared; layer 0 dense
==================  =====  ======  =====  =====  ======  =======  =====================================

The MoE presets route sparsely (top-k dispatch through the expert-parallel region,
:mod:`apmodel.models.moe`); ``config(name, routing="dense")`` gives the dense reference.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from apmodel.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Transformer
from apmodel.models.gpt2 import GPT2, GPT2Config
from apmodel.models.llama3 import LlamaConfig, Transformer
from apmodel.models.loss import cross_entropy_loss
from apmodel.models.moe import MoEConfig, MoETransformer

# name -> (config class, model class, config fields)
PRESETS: MappingProxyType = MappingProxyType(
    {
        "llama3-debug": (
            LlamaConfig,
            Transformer,
            dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden_dim=768, vocab_size=2048,
                 max_seq_len=512),
        ),
        # Meta Llama 3 8B / 70B model cards (params.json)
        "llama3-8b": (
            LlamaConfig,
            Transformer,
            dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336, vocab_size=128256,
                 rope_theta=500000.0, max_seq_len=8192),
        ),
        # LLaMA-3 8B whose attention may run context parallel (models.attention), for long sequences
        "llama3-8b-cp": (
            LlamaConfig,
            Transformer,
            dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336, vocab_size=128256,
                 rope_theta=500000.0, max_seq_len=131072, context_parallel=True),
        ),
        "llama3-70b": (
            LlamaConfig,
            Transformer,
            dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=28672, vocab_size=128256,
                 rope_theta=500000.0, max_seq_len=8192),
        ),
        # Meta Llama 3.1 405B model card (params.json: dim 16384, 126 layers, 128 heads, 8 kv heads,
        # ffn 53248, 128K context)
        "llama3-405b": (
            LlamaConfig,
            Transformer,
            dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden_dim=53248, vocab_size=128256,
                 rope_theta=500000.0, max_seq_len=131072),
        ),
        # Qwen3-32B (Qwen/Qwen3-32B config.json: hidden 5120, 64 layers, 64 heads of 128, 8 kv heads,
        # intermediate 25600, vocab 151936, rope theta 1e6, rms eps 1e-6, QK-norm, 40960 positions)
        "qwen3-32b": (
            LlamaConfig,
            Transformer,
            dict(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, attention_head_dim=128, ffn_hidden_dim=25600,
                 vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6, max_seq_len=40960, qk_norm=True),
        ),
        # the paper's "30B model with hybrid sliding-window / full attention" (MuseGlimmer 30B) has no
        # published config here, so Gemma 3 27B's published sizes and attention pattern
        # (google/gemma-3-27b-pt config.json: hidden 5376, 62 layers, 32 heads of 128, 16 kv heads,
        # intermediate 21504, vocab 262208, sliding window 1024, every 6th layer global, rope theta 1e6,
        # rms eps 1e-6, QK-norm, 131072 positions) in the LLaMA-style block (SwiGLU, untied output,
        # one RoPE table: Gemma's 1e4 base of the local layers, its soft-capping and sandwich norms
        # left out), ≈ 28.4e9 parameters
        "hybrid-swa-30b": (
            LlamaConfig,
            Transformer,
            dict(dim=5376, n_layers=62, n_heads=32, n_kv_heads=16, attention_head_dim=128, ffn_hidden_dim=21504,
                 vocab_size=262208, rope_theta=1000000.0, norm_eps=1e-6, max_seq_len=131072, qk_norm=True,
                 sliding_window=1024, full_attention_every=6),
        ),
        # its debug size: window 8 (the sample sequences are longer), every 2nd layer full
        "hybrid-swa-debug": (
            LlamaConfig,
            Transformer,
            dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden_dim=768, vocab_size=2048,
                 max_seq_len=512, qk_norm=True, sliding_window=8, full_attention_every=2),
        ),
        # OpenAI GPT-2 (2019) small and medium
        "gpt2": (GPT2Config, GPT2, dict(dim=768, n_layers=12, n_heads=12, vocab_size=50257, max_seq_len=1024)),
        "gpt2-medium": (
            GPT2Config,
            GPT2,
            dict(dim=1024, n_layers=24, n_heads=16, vocab_size=50257, max_seq_len=1024),
        ),
        "moe-debug": (
            MoEConfig,
            MoETransformer,
            dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden_dim=768, moe_hidden_dim=128,
                 n_routed_experts=8, n_shared_experts=1, top_k=2, n_dense_layers=1, vocab_size=2048,
                 max_seq_len=512),
        ),
        # Qwen3-235B-A22B (Qwen/Qwen3-235B-A22B config.json: hidden 4096, 94 layers, 64 heads of 128,
        # 4 kv heads, 128 experts of 1536, top-8 renormalised, no shared experts, every layer MoE,
        # vocab 151936, rope theta 1e6, QK-norm, 40960 positions)
        "qwen3-235b-a22b": (
            MoEConfig,
            MoETransformer,
            dict(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, attention_head_dim=128, ffn_hidden_dim=12288,
                 moe_hidden_dim=1536, n_routed_experts=128, n_shared_experts=0, top_k=8, n_dense_layers=0,
                 renormalize_topk=True, vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6,
                 max_seq_len=40960, qk_norm=True),
        ),
        # DeepSeek-V3 671B (deepseek-ai/DeepSeek-V3 config.json and the technical report, arXiv:2412.19437:
        # hidden 7168, 61 layers, 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64,
        # v 128, 256 routed experts of 2048 + 1 shared, 8 per token from 4 of 8 groups, sigmoid scores,
        # norm_topk_prob, routed_scaling_factor 2.5, first_k_dense_replace 3 with intermediate 18432,
        # vocab 129280, rms eps 1e-6, rope theta 1e4; 4K pretraining context, before YaRN's extension)
        "deepseek-v3": (DeepSeekV3Config, DeepSeekV3Transformer, dict()),
        # the paper's "16B MoE with the DeepSeek-V3 architecture": no published config, so
        # DeepSeek-V2-Lite's published sizes (deepseek-ai/DeepSeek-V2-Lite config.json, 15.7B parameters:
        # hidden 2048, 27 layers, 16 heads, no q compression, kv_lora_rank 512, qk_nope 128, qk_rope 64,
        # v 128, 64 routed experts of 1408 + 2 shared, top-6, first layer dense with intermediate 10944,
        # vocab 102400, routed_scaling_factor 1.0, one expert group) with V3's routing (sigmoid scores,
        # normalised top-k, selection bias) in place of V2-Lite's softmax; 16384 positions as the
        # paper's baseline (TorchTitan's DeepSeek-V3 16B) has them, for the paper's 8K sequences
        "deepseek-v3-16b": (
            DeepSeekV3Config,
            DeepSeekV3Transformer,
            dict(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, ffn_hidden_dim=10944, moe_hidden_dim=1408,
                 n_routed_experts=64, n_shared_experts=2, top_k=6, n_dense_layers=1, vocab_size=102400,
                 q_lora_rank=0, n_group=1, topk_group=1, routed_scaling_factor=1.0, max_seq_len=16384),
        ),
        "deepseek-v3-debug": (
            DeepSeekV3Config,
            DeepSeekV3Transformer,
            dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=8, ffn_hidden_dim=768, moe_hidden_dim=128,
                 n_routed_experts=8, n_shared_experts=1, top_k=2, n_dense_layers=1, vocab_size=2048,
                 max_seq_len=512, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                 v_head_dim=32, n_group=4, topk_group=2),
        ),
        # DeepSeekMoE 16B (DeepSeek-AI 2024), with GQA-capable attention (n_kv_heads = n_heads: MHA)
        "deepseek-moe-16b": (
            MoEConfig,
            MoETransformer,
            dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=16, ffn_hidden_dim=10944, moe_hidden_dim=1408,
                 n_routed_experts=64, n_shared_experts=2, top_k=6, n_dense_layers=1, vocab_size=102400,
                 max_seq_len=4096),
        ),
    }
)

ModelConfig = LlamaConfig | GPT2Config | MoEConfig | DeepSeekV3Config


def config(name: str, **overrides: Any) -> ModelConfig:
    """The config dataclass of preset ``name`` with fields replaced by ``overrides``."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
    cfg_cls, _, fields = PRESETS[name]
    known = {f.name for f in dataclasses.fields(cfg_cls)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"model preset {name!r}: unknown config field(s) {bad}; known: {sorted(known)}")
    return cfg_cls(**{**fields, **overrides})


def build(name: str | ModelConfig, **overrides: Any) -> nn.Module:
    """Build a model from a preset name (or a config object). Builds on the current default device:
    wrap in ``with torch.device("meta"):`` to build without allocating memory."""
    cfg = dataclasses.replace(name, **overrides) if not isinstance(name, str) else config(name, **overrides)
    model_cls = {LlamaConfig: Transformer, GPT2Config: GPT2, MoEConfig: MoETransformer,
                 DeepSeekV3Config: DeepSeekV3Transformer}.get(type(cfg))
    if model_cls is None:
        raise TypeError(f"build: expected a preset name or a model config, got {type(cfg).__name__}")
    model = model_cls(cfg)
    if isinstance(name, str) and set(overrides) <= {"n_layers"}:
        # what `apmodel explain` needs to rebuild it from a saved plan (the CLI's --model/--layers)
        model.apmodel_workload = {"model": name, "layers": overrides.get("n_layers")}
    return model


def sample_inputs(
    name_or_config: str | ModelConfig,
    batch: int,
    seq: int,
    device: str | torch.device = "meta",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)``, both int64 ``[batch, seq]`` with ids below the vocabulary size."""
    cfg = config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    if batch < 1 or seq < 1:
        raise ValueError(f"sample_inputs: batch={batch} and seq={seq} must be positive")
    if seq > cfg.max_seq_len:
        raise ValueError(f"sample_inputs: seq={seq} exceeds the model's max_seq_len={cfg.max_seq_len}")
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator, dtype=torch.int64, device=device)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator, dtype=torch.int64, device=device)
    return tokens, targets


__all__ = [
    "PRESETS",
    "DeepSeekV3Config",
    "DeepSeekV3Transformer",
    "GPT2",
    "GPT2Config",
    "LlamaConfig",
    "MoEConfig",
    "MoETransformer",
    "Transformer",
    "build",
    "config",
    "cross_entropy_loss",
    "sample_inputs",
]
