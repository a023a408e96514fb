"""Tiny random-initialised HF models for tests (no hub access needed)."""
from __future__ import annotations

import torch


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
    kw.update(overrides)
    cfg = LlamaConfig(**kw)
    cfg.architectures = ["LlamaForCausalLM"]
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
    kw.update(overrides)
    cfg = MistralConfig(**kw)
    cfg.architectures = ["MistralForCausalLM"]
    return cfg


def tiny_gpt2_config(**overrides):
    from transformers import GPT2Config

    kw = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
              activation_function="gelu_new", layer_norm_epsilon=1e-5,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    cfg = GPT2Config(**kw)
    cfg.architectures = ["GPT2LMHeadModel"]
    return cfg


def tiny_qwen2_config(**overrides):
    """Qwen2 (GQA, q/k/v bias); sliding window off, as Qwen2 checkpoints ship it."""
    from transformers import Qwen2Config

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    cfg = Qwen2Config(**kw)
    cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


def tiny_qwen3_config(**overrides):
    """Qwen3 (GQA, per-head q/k norms, a head_dim that is not hidden / heads, no biases)."""
    from transformers import Qwen3Config

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=24,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
              use_sliding_window=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    cfg = Qwen3Config(**kw)
    cfg.architectures = ["Qwen3ForCausalLM"]
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
