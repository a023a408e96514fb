"""The random-weight shapes a benchmark or a plan may take instead of a checkpoint
(``infergraft bench --model llama2-7b``, ``infergraft plan mixtral-8x7b``)."""

SHAPES = {  # random-initialised shapes: name -> config overrides (LLaMA's unless model_type)
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                      max_position_embeddings=4096),
    # 40 layers of 40 heads: the 40-layer example of the seed text's K/V arithmetic
    "llama2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                       num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                       max_position_embeddings=4096),
    # GQA (8 kv heads for 32 query heads): the large-batch attention plans differ from MHA's
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000.0),
    # GQA, 80 layers: 138 GB of bf16 weights, more than one H200 holds (bench_parallel)
    "llama2-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                       max_position_embeddings=4096),
    # a mixture of experts: 46.7B parameters, 12.9B active (top-2 of 8 experts a layer)
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                         max_position_embeddings=32768, rope_theta=1000000.0),
    # Qwen3 (the contrib package's policies): q/k RMSNorm per head, GQA, head_dim 128
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1000000.0),
    # 30.5B parameters, 3.3B active (top-8 of 128 small experts a layer)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          vocab_size=151936, max_position_embeddings=40960,
                          rope_theta=1000000.0),
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
                 max_position_embeddings=2048),
}


def shape_config(name: str):
    """The HF config of the random shape ``name`` (a LlamaConfig unless it names its
    ``model_type``)."""
    from transformers import LlamaConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    kw = dict(SHAPES[name])
    kind = kw.pop("model_type", "llama")
    cls, arch = {"llama": (LlamaConfig, "LlamaForCausalLM"),
                 "mixtral": (MixtralConfig, "MixtralForCausalLM"),
                 "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
                 "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM")}[kind]
    return cls(**kw, rms_norm_eps=1e-5, tie_word_embeddings=False, architectures=[arch])
