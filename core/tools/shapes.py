"""The random-weight LLaMA shapes a benchmark or a plan may take instead of a checkpoint
(``infergraft bench --model llama2-7b``, ``infergraft plan llama2-7b``)."""

SHAPES = {  # random-initialised LLaMA shapes: name -> LlamaConfig overrides
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
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
                 max_position_embeddings=2048),
}


def shape_config(name: str):
    """The LlamaConfig of the random shape ``name``."""
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[name], rms_norm_eps=1e-5, tie_word_embeddings=False,
                       architectures=["LlamaForCausalLM"])
