"""GPT-2 family (GPT2LMHeadModel): LayerNorm with bias, learned positions, GELU MLP,
biases everywhere, tied LM head.

HF stores GPT-2's projections as ``Conv1D`` weights, [in, out]: transposed they are
``nn.Linear``'s [out, in], and ``c_attn``'s [H, 3H] becomes exactly our fused
qkv slot (q | k | v along dim 0).
"""
from infergraft.core.errors import UnsupportedModelError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.policy import Policy, WeightMap, WeightRule
from infergraft.core.spec import ModelSpec, check_size

#: HF activation_function -> ModelSpec.activation
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}

_RULES = (
    WeightRule("transformer.wte.weight", "embed.weight"),
    WeightRule("transformer.wpe.weight", "pos_embed.weight"),
    WeightRule("transformer.h.{i}.ln_1.weight", "layers.{i}.attn_norm.weight"),
    WeightRule("transformer.h.{i}.ln_1.bias", "layers.{i}.attn_norm.bias"),
    WeightRule("transformer.h.{i}.attn.c_attn.weight", "layers.{i}.qkv.weight", transpose=True),
    WeightRule("transformer.h.{i}.attn.c_attn.bias", "layers.{i}.qkv.bias"),
    WeightRule("transformer.h.{i}.attn.c_proj.weight", "layers.{i}.o.weight", transpose=True),
    WeightRule("transformer.h.{i}.attn.c_proj.bias", "layers.{i}.o.bias"),
    WeightRule("transformer.h.{i}.ln_2.weight", "layers.{i}.mlp_norm.weight"),
    WeightRule("transformer.h.{i}.ln_2.bias", "layers.{i}.mlp_norm.bias"),
    WeightRule("transformer.h.{i}.mlp.c_fc.weight", "layers.{i}.fc_in.weight", transpose=True),
    WeightRule("transformer.h.{i}.mlp.c_fc.bias", "layers.{i}.fc_in.bias"),
    WeightRule("transformer.h.{i}.mlp.c_proj.weight", "layers.{i}.down.weight", transpose=True),
    WeightRule("transformer.h.{i}.mlp.c_proj.bias", "layers.{i}.down.bias"),
    WeightRule("transformer.ln_f.weight", "final_norm.weight"),
    WeightRule("transformer.ln_f.bias", "final_norm.bias"),
)
# the causal-mask buffers older checkpoints saved (attn.bias / attn.masked_bias)
_IGNORE = (r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$",)


def _refuse(what: str):
    raise UnsupportedModelError(f"GPT2LMHeadModel: {what} is not supported")


class GPT2Policy(Policy):
    name = "gpt2"
    architectures = ("GPT2LMHeadModel",)
    model_types = ("gpt2",)

    def describe(self, config) -> ModelSpec:
        self.check(config)
        act = getattr(config, "activation_function", "gelu_new")
        if act not in ACTIVATIONS:
            _refuse(f"activation_function {act!r} (supported: {', '.join(ACTIVATIONS)})")
        if not getattr(config, "scale_attn_weights", True):
            _refuse("scale_attn_weights=False (unscaled attention)")
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            _refuse("scale_attn_by_inverse_layer_idx=True")
        if getattr(config, "add_cross_attention", False):
            _refuse("add_cross_attention=True (a decoder-only engine has no encoder)")
        h, heads = config.n_embd, config.n_head
        check_size("GPT2LMHeadModel", "hidden_size", h)  # before the modulo below
        check_size("GPT2LMHeadModel", "num_heads", heads)
        if h % heads:
            raise UnsupportedModelError(f"GPT2LMHeadModel: n_embd={h} is not a multiple of "
                                        f"n_head={heads}")
        inner = getattr(config, "n_inner", None)
        eos = getattr(config, "eos_token_id", None)
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return ModelSpec(
            architecture="GPT2LMHeadModel",
            num_layers=config.n_layer,
            hidden_size=h,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=h // heads,
            intermediate_size=4 * h if inner is None else inner,  # n_inner=0 is refused
            vocab_size=config.vocab_size,
            max_position=config.n_positions,
            norm="layer",
            norm_eps=config.layer_norm_epsilon,
            activation=ACTIVATIONS[act],
            gated_mlp=False,
            position="learned",
            rope=None,
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
            bos_token_id=getattr(config, "bos_token_id", None),
            eos_token_ids=eos,
            pad_token_id=getattr(config, "pad_token_id", None),
        )

    def weight_map(self, spec: ModelSpec) -> WeightMap:
        rules = list(_RULES)
        # the original hub checkpoints were saved from GPT2Model: same keys without the
        # "transformer." prefix; accept them as stand-ins
        aliases = []
        for r in rules:
            layers = range(spec.num_layers) if "{i}" in r.source else [None]
            for i in layers:
                key = r.source if i is None else r.source.replace("{i}", str(i))
                aliases.append((key[len("transformer."):], key))
        if spec.tie_embeddings:  # checkpoints keep either name of the shared tensor
            aliases.append(("lm_head.weight", "transformer.wte.weight"))
        else:
            rules.append(WeightRule("lm_head.weight", "lm_head.weight"))
        return WeightMap(tuple(rules), ignore=_IGNORE, aliases=tuple(aliases))


@hookimpl
def infergraft_register_policies(register):
    register(GPT2Policy())
