"""Tiny random-initialised HF models for tests (no hub access needed)."""
from __future__ import annotations

import torch


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
    return _config(LlamaConfig, "LlamaForCausalLM", kw, overrides)


def _config(cls, architecture: str, defaults: dict, overrides: dict):
    """``cls(**defaults)`` with ``overrides`` over them, naming ``architecture``."""
    cfg = cls(**{**defaults, **overrides})
    cfg.architectures = [architecture]
    return cfg


def random_model(config, seed: int = 0, dtype=torch.float32, scale: float = 1.0):
    """An HF model of ``config`` with seeded random weights (std scaled for lively logits)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config.initializer_range = 0.02 * scale
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return model


def with_random_norm_weights(hf, seed: int = 0):
    """``hf`` with its norm weights drawn around 1 (HF initialises them to ones, which
    would make folding them into the projections a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return hf


def random_gemma(config, seed: int = 1, scale: float = 10.0, norm_std: float = 2.0):
    """A random HF Gemma of ``config``: projections lively (scale 10) and its norms' weights
    drawn around 0 (HF initialises them to 0, a scale of 1 + 0), so that the softcaps
    bite and greedy tokens vary. That model is chaotic in bfloat16 (HF's own bf16 forward is
    20-60% off its float32 one); a bf16 comparison takes a tamer one (scale 3, norm_std 0.5)."""
    hf = random_model(config, seed=seed, scale=scale)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(norm_std * torch.randn(p.shape, generator=g))
    return hf


def random_prompt(n: int, vocab: int, seed: int, avoid=(0, 1, 2)) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g).tolist()
    return [t if t not in avoid else 3 + t for t in ids]


def tiny_mistral_config(**overrides):
    from transformers import MistralConfig

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, sliding_window=16, rms_norm_eps=1e-5,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _config(MistralConfig, "MistralForCausalLM", kw, overrides)


def longrope_parameters(rotary_dim: int, theta: float = 10000.0, **extra):
    """LongRoPE's rope_parameters with distinct short and long factors, rotary_dim / 2 each."""
    half = rotary_dim // 2
    return dict(rope_type="longrope", rope_theta=theta,
                short_factor=[1.0 + 0.15 * i for i in range(half)],
                long_factor=[1.5 + 0.6 * i for i in range(half)], **extra)


def tiny_phi3_config(**overrides):
    """Phi-3 (fused qkv_proj / gate_up_proj, GQA); LongRoPE over 32 original positions of
    512, a quarter of each 16-dim head passing through unrotated (Phi-4-mini's partial
    rotary): override ``rope_parameters`` for others."""
    from transformers import Phi3Config

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              original_max_position_embeddings=32, sliding_window=None, rms_norm_eps=1e-5,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              rope_parameters=longrope_parameters(12, partial_rotary_factor=0.75))
    return _config(Phi3Config, "Phi3ForCausalLM", kw, overrides)


def tiny_gpt2_config(**overrides):
    from transformers import GPT2Config

    kw = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
              activation_function="gelu_new", layer_norm_epsilon=1e-5,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _config(GPT2Config, "GPT2LMHeadModel", kw, overrides)


def tiny_qwen2_config(**overrides):
    """Qwen2 (GQA, q/k/v bias); sliding window off, as Qwen2 checkpoints ship it."""
    from transformers import Qwen2Config

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _config(Qwen2Config, "Qwen2ForCausalLM", kw, overrides)


def tiny_qwen3_config(**overrides):
    """Qwen3 (GQA, per-head q/k norms, a head_dim that is not hidden / heads, no biases)."""
    from transformers import Qwen3Config

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=24,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
              use_sliding_window=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _config(Qwen3Config, "Qwen3ForCausalLM", kw, overrides)


def tiny_mixtral_config(**overrides):
    """Mixtral (GQA, 8 SwiGLU experts of 32 rows, top-2 renormalised, no window)."""
    from transformers import MixtralConfig

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
              num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-5,
              sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
    return _config(MixtralConfig, "MixtralForCausalLM", kw, overrides)


def tiny_qwen3_moe_config(**overrides):
    """Qwen3-MoE (Qwen3's q/k-norm attention, head_dim 24; 6 experts of 24 rows, top-2,
    ``norm_topk_prob`` off; layer 1 of 3 a dense MLP of 112 rows: ``mlp_only_layers``)."""
    from transformers import Qwen3MoeConfig

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=112, moe_intermediate_size=24,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
              num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
              decoder_sparse_step=1, max_position_embeddings=512, rms_norm_eps=1e-6,
              tie_word_embeddings=False, use_sliding_window=False, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
    return _config(Qwen3MoeConfig, "Qwen3MoeForCausalLM", kw, overrides)


def tiny_gemma2_config(**overrides):
    """Gemma 2: sliding window 8 on every other layer (global between), both softcaps, a
    query_pre_attn_scalar that is not head_dim, GQA, tied embeddings (as Gemma ships).
    HF's eager attention: transformers 5.17 runs Gemma 2 on SDPA by default, which drops the
    attention softcap (5.25 refuses SDPA for it)."""
    from transformers import Gemma2Config

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=8,
              query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
              final_logit_softcapping=3.0, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = _config(Gemma2Config, "Gemma2ForCausalLM", kw, overrides)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_gemma3_config(**overrides):
    """Gemma 3 (text): five local layers (window 8, RoPE base 10k) then a global one
    (base 1M, linear scaling x2), per-head q / k norms, a final logit softcap."""
    from transformers import Gemma3TextConfig

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=7,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=8,
              query_pre_attn_scalar=24, final_logit_softcapping=3.0,
              rope_parameters={"sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 10_000.0},
                               "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                  "rope_theta": 1_000_000.0}},
              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = _config(Gemma3TextConfig, "Gemma3ForCausalLM", kw, overrides)
    cfg._attn_implementation = "eager"  # as Gemma 2's: the same reference on every version
    return cfg


def byte_tokenizer(vocab_size: int = 256):
    """A byte-level tokenizer of 256 tokens (one a byte, no merges) for the tiny models,
    built offline: what a tiny model's directory needs where a tool reads text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert vocab_size >= len(alphabet), vocab_size
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)
