"""LLaMA family (LlamaForCausalLM): RMSNorm, RoPE, GQA, SiLU-gated MLP."""
from infergraft.core.errors import UnsupportedModelError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.policy import Policy, WeightMap, WeightRule
from infergraft.core.rope import rope_from_config
from infergraft.core.spec import ModelSpec, check_size, derived_head_dim

_DECODER_RULES = (
    WeightRule("model.embed_tokens.weight", "embed.weight"),
    WeightRule("model.layers.{i}.input_layernorm.weight", "layers.{i}.attn_norm.weight"),
    WeightRule("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.qkv.weight", part=0),
    WeightRule("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.qkv.weight", part=1),
    WeightRule("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.qkv.weight", part=2),
    WeightRule("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.o.weight"),
    WeightRule("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.mlp_norm.weight"),
    WeightRule("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.gate_up.weight", part=0),
    WeightRule("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.gate_up.weight", part=1),
    WeightRule("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.down.weight"),
    WeightRule("model.norm.weight", "final_norm.weight"),
)
_QKV_BIAS_RULES = tuple(
    WeightRule(f"model.layers.{{i}}.self_attn.{p}_proj.bias", "layers.{i}.qkv.bias", part=n)
    for n, p in enumerate("qkv"))


def llama_like_spec(config, *, architecture: str, qkv_bias: bool = False,
                    sliding_window=None) -> ModelSpec:
    """ModelSpec for the LLaMA-shaped families (LLaMA, Mistral, Qwen2, ...)."""
    heads = config.num_attention_heads
    # None (not 0) means "not given": a 0 or a negative head count or head_dim is
    # refused (here or by ModelSpec), not replaced by a default
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        head_dim = derived_head_dim(architecture, config.hidden_size, heads)
    else:  # before rope_from_config scales it
        check_size(architecture, "head_dim", head_dim)
    kv_heads = getattr(config, "num_key_value_heads", None)
    eos = config.eos_token_id
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    attention_bias = bool(getattr(config, "attention_bias", False))  # LLaMA: on q, k, v and o
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"{architecture}: hidden_act {act!r} is not supported "
                                    "(supported: silu)")
    return ModelSpec(
        architecture=architecture,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=heads if kv_heads is None else kv_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_position=config.max_position_embeddings,
        norm="rms",
        norm_eps=config.rms_norm_eps,
        activation="silu",
        gated_mlp=True,
        position="rope",
        rope=rope_from_config(config, head_dim),
        sliding_window=sliding_window,
        qkv_bias=qkv_bias or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_ids=eos,
        pad_token_id=getattr(config, "pad_token_id", None),
    )


def llama_like_weight_map(spec: ModelSpec) -> WeightMap:
    rules = list(_DECODER_RULES)
    if spec.qkv_bias:
        rules += _QKV_BIAS_RULES
    if spec.o_bias:
        rules.append(WeightRule("model.layers.{i}.self_attn.o_proj.bias", "layers.{i}.o.bias"))
    if spec.mlp_bias:
        rules += [WeightRule("model.layers.{i}.mlp.gate_proj.bias", "layers.{i}.gate_up.bias", part=0),
                  WeightRule("model.layers.{i}.mlp.up_proj.bias", "layers.{i}.gate_up.bias", part=1),
                  WeightRule("model.layers.{i}.mlp.down_proj.bias", "layers.{i}.down.bias")]
    aliases = ()
    if spec.tie_embeddings:  # checkpoints keep either name of the shared tensor
        aliases = (("lm_head.weight", "model.embed_tokens.weight"),)
    else:
        rules.append(WeightRule("lm_head.weight", "lm_head.weight"))
    return WeightMap(tuple(rules), ignore=(r".*rotary_emb\.inv_freq$",), aliases=aliases)


class LlamaPolicy(Policy):
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)

    def describe(self, config) -> ModelSpec:
        self.check(config)
        return llama_like_spec(config, architecture="LlamaForCausalLM")

    def weight_map(self, spec: ModelSpec) -> WeightMap:
        return llama_like_weight_map(spec)


@hookimpl
def infergraft_register_policies(register):
    register(LlamaPolicy())
