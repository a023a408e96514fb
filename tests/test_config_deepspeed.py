"""DeepSpeed's inference keys, each mapped onto build's arguments and plugins, refused, or
ignored with the warning that says why (core/config/deepspeed.py, docs/config.md)."""
import warnings

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from infergraft.core.config import DEEPSPEED_KEYS, OWN_KEYS, resolve_config
from infergraft.core.config.deepspeed import MAPPERS
from infergraft.core.config.table import TRAINING_KEYS
from infergraft.core.errors import ConfigError, ConfigWarning

# DeepSpeedInferenceConfig's fields and aliases (deepspeed/inference/config.py)
INFERENCE_FIELDS = (
    "replace_with_kernel_inject", "kernel_inject", "dtype", "tensor_parallel", "tp",
    "enable_cuda_graph", "use_triton", "triton_autotune", "zero", "triangular_masking", "tm",
    "moe", "keep_module_on_host", "quant", "checkpoint", "base_dir", "set_empty_params",
    "save_mp_checkpoint_path", "checkpoint_config", "ckpt_config", "return_tuple",
    "training_mp_size", "replace_method", "injection_policy", "injection_dict",
    "injection_policy_tuple", "config", "args", "max_out_tokens", "max_tokens",
    "min_out_tokens", "min_tokens", "transposed_mode", "mp_size", "mpu", "ep_size", "ep_group",
    "expert_group", "ep_mp_group", "expert_mp_group", "moe_experts", "moe_type")


def quiet(config):
    """resolve_config(config), failing on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return resolve_config(config)


def test_every_inference_field_is_in_the_table_and_handled():
    missing = [f for f in INFERENCE_FIELDS if f not in DEEPSPEED_KEYS
               and not any(k.startswith(f + ".") for k in DEEPSPEED_KEYS)]
    assert missing == []
    tops = {k.split(".")[0] for k in DEEPSPEED_KEYS}
    unhandled = sorted(k for k in tops if k not in MAPPERS and k not in TRAINING_KEYS
                       and k not in OWN_KEYS)
    assert unhandled == []
    assert sorted(set(MAPPERS) - tops) == []  # every key read is in the table (and docs)


@pytest.mark.parametrize("spelling, dtype", [
    ("fp16", "float16"), ("float16", "float16"), ("half", "float16"),
    ("torch.float16", "float16"), (torch.half, "float16"), ("BF16", "bfloat16"),
    ("bfloat16", "bfloat16"), (torch.bfloat16, "bfloat16"), ("fp32", "float32"),
    ("float", "float32"), ("float32", "float32"), (torch.float32, "float32")])
def test_dtype_spellings(spelling, dtype):
    assert quiet({"dtype": spelling}) == {"dtype": dtype, "plugins": []}


@pytest.mark.parametrize("spelling", ["int8", torch.int8])
def test_int8_is_float16_with_int8_weights(spelling):
    assert quiet({"dtype": spelling}) == {"dtype": "float16", "plugins": ["int8"]}
    assert quiet({"dtype": spelling, "bf16": {"enabled": True}})["dtype"] == "bfloat16"


def test_fp16_and_bf16_blocks():
    assert quiet({"fp16": {"enabled": True}}) == {"dtype": "float16", "plugins": []}
    assert quiet({"bf16": {"enabled": True}, "fp16": {"enabled": False}})["dtype"] == "bfloat16"
    with pytest.raises(ConfigError, match="fp16.enabled=true and bf16.enabled=true"):
        resolve_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match='dtype="fp32" and fp16.enabled=true'):
        resolve_config({"dtype": "fp32", "fp16": {"enabled": True}})
    with pytest.raises(ConfigError, match='dtype="fp8" is not valid; accepted: one of fp16'):
        resolve_config({"dtype": "fp8"})


@pytest.mark.parametrize("config", [{"tensor_parallel": {"tp_size": 2}}, {"tp": {"tp_size": 2}},
                                    {"mp_size": 2}, {"tensor_parallel": {"tp_size": 2,
                                                                         "enabled": True}}])
def test_tensor_parallel_sizes(config):
    assert quiet(config) == {"plugins": ["tp"], "tp_size": 2}


def test_tensor_parallel_of_one_or_disabled_is_nothing_and_objects_are_refused():
    assert quiet({"tensor_parallel": {"tp_size": 1}}) == {"plugins": []}
    assert quiet({"tensor_parallel": {"tp_size": 4, "enabled": False}}) == {"plugins": []}
    with pytest.raises(ConfigError, match="tensor_parallel.tp_group=.* a Python object"):
        resolve_config({"tensor_parallel": {"tp_size": 2, "tp_group": object()}})
    with pytest.raises(ConfigError, match="tensor_parallel.tp_size=2 and mp_size=4"):
        resolve_config({"tensor_parallel": {"tp_size": 2}, "mp_size": 4})
    with pytest.raises(ConfigError, match='tensor_parallel.tp_size="2" is not valid'):
        resolve_config({"tensor_parallel": {"tp_size": "2"}})
    # an integer is the pp planner's option of that name, passed through
    assert quiet({"plugins": ["pp"], "tensor_parallel": 2}) == {"plugins": ["pp"],
                                                                "tensor_parallel": 2}


def test_kernel_inject():
    assert quiet({"kernel_inject": True}) == {"plugins": []}  # our default: the fused path
    assert quiet({"replace_with_kernel_inject": False}) == {"kernels": "torch", "plugins": []}
    with pytest.raises(ConfigError, match='kernel_inject="yes" is not valid'):
        resolve_config({"kernel_inject": "yes"})
    with pytest.raises(ConfigError, match="kernel_inject=true .* kernels=\"torch\""):
        resolve_config({"kernel_inject": True, "kernels": "torch"})
    assert quiet({"use_triton": True})["kernels"] == "triton"


@pytest.mark.parametrize("policy, name", [
    ("llama", "llama"), ("LlamaForCausalLM", "llama"), ("LlamaDecoderLayer", "llama"),
    (LlamaDecoderLayer, "llama"), ("MistralDecoderLayer", "mistral"), ("GPT2Block", "gpt2"),
    ("GPT2LMHeadModel", "gpt2")])
def test_injection_policy_names(policy, name):
    assert quiet({"injection_policy": policy}) == {"plugins": [name]}


@pytest.mark.parametrize("mapping", [
    {LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")},
    {"LlamaDecoderLayer": ["self_attn.o_proj", "mlp.down_proj"]}])
def test_injection_policy_mapping_form_is_explained(mapping):
    with pytest.warns(ConfigWarning, match="policy of LlamaDecoderLayer is used; the module "
                                           "names .*self_attn.o_proj.* are not needed"):
        assert resolve_config({"injection_policy": mapping}) == {"plugins": ["llama"]}
    with pytest.warns(ConfigWarning, match="not needed"):
        out = resolve_config({"injection_policy_tuple": (LlamaDecoderLayer, "mlp.down_proj")})
    assert out == {"plugins": ["llama"]}


def test_an_unknown_policy_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"names no registered policy .* llama "
                                          r"\(LlamaForCausalLM\)"):
        resolve_config({"injection_policy": "BertLayer"})
    with pytest.raises(ConfigError, match="ask for different policy"):
        resolve_config({"injection_policy": {"LlamaDecoderLayer": [], "GPT2Block": []}})


@pytest.mark.parametrize("quant, plugins", [
    ({"enabled": True, "bits": 8}, ["int8"]), ({"weight": {"num_bits": 8}}, ["int8"]),
    ({"enabled": True}, ["int8"]), ({"kv_cache_quant": True}, ["kv-int8"]),
    ({"kv_cache_quant": "int8"}, ["kv-int8"]), ({"kv_cache_quant": 8}, ["kv-int8"]),
    # enabled switches the section on: beside kv_cache_quant alone, the K/V (the seed's
    # {"enabled": true, "kv_cache_quant": true} with fp16 weights); with bits, both
    ({"enabled": True, "kv_cache_quant": True}, ["kv-int8"]),
    ({"enabled": True, "bits": 8, "kv_cache_quant": True}, ["int8", "kv-int8"]),
    ({"enabled": True, "kv_cache_quant": False}, ["int8"]),
    ({"bits": 4}, ["int4"]), ({"enabled": True, "bits": 4, "kv_cache_quant": True},
                              ["int4", "kv-int8"]),
    ({"weight": {"num_bits": 4, "q_type": "asymmetric"}}, ["int4"]),
    ({"enabled": False, "bits": 8, "kv_cache_quant": False}, [])])
def test_quantization(quant, plugins):
    assert quiet({"quantization": quant}) == {"plugins": plugins}
    assert quiet({"quant": quant}) == {"plugins": plugins}


def test_four_bits_take_deepspeed_s_group_size_else_ours():
    assert quiet({"quantization": {"bits": 4, "group_size": 64}}) == \
        {"group_size": 64, "plugins": ["int4"]}
    assert quiet({"quant": {"weight": {"num_bits": 4, "group_size": 32}}}) == \
        {"group_size": 32, "plugins": ["int4"]}
    assert quiet({"quantization": {"bits": 4}}) == {"plugins": ["int4"]}  # int4's 128
    with pytest.raises(ConfigError, match=r"quantization.group_size=100 is not valid; "
                                          r"accepted: 32, 64, 128 \(.*default 128\)"):
        resolve_config({"quantization": {"bits": 4, "group_size": 100}})
    with pytest.raises(ConfigError, match="ask for different group_size"):
        resolve_config({"quantization": {"bits": 4, "group_size": 64,
                                         "weight": {"group_size": 32}}})
    with pytest.warns(ConfigWarning, match="int4 keeps a zero-point per group"):
        resolve_config({"quantization": {"bits": 4, "weight": {"q_type": "symmetric"}}})
    with pytest.warns(ConfigWarning, match="group_size=64 .int8 keeps one scale per output row"):
        resolve_config({"quantization": {"bits": 8, "group_size": 64}})


def test_quantization_refusals():
    with pytest.raises(ConfigError, match=r"quantization.bits=3 is not valid; accepted: 8 "
                                          r"\(int8 weights, W8A16\) or 4 \(int4 weights"):
        resolve_config({"quantization": {"enabled": True, "bits": 3}})
    with pytest.raises(ConfigError, match="quant.weight.num_bits=2 .* accepted: 8"):
        resolve_config({"quant": {"weight": {"num_bits": 2}}})
    with pytest.raises(ConfigError, match='q_type="asymmetric" is not valid'):
        resolve_config({"quantization": {"enabled": True, "weight": {"q_type": "asymmetric"}}})
    with pytest.raises(ConfigError, match='ask for different weights \\("int8" and "int4"\\)'):
        resolve_config({"dtype": "int8", "quantization": {"bits": 4}})
    with pytest.raises(ConfigError, match="kv_cache_quant=4 is not valid"):
        resolve_config({"quantization": {"kv_cache_quant": 4}})


@pytest.mark.parametrize("config", [
    {"moe": True}, {"moe": {"enabled": True}}, {"moe": {"ep_size": 2}},
    {"moe": {"num_experts": [8]}}, {"ep_size": 2}, {"moe_experts": [8]},
    {"moe_type": "residual"}])
def test_moe_is_refused(config):
    with pytest.raises(ConfigError, match="mixture-of-experts models are not supported"):
        resolve_config(config)


def test_moe_off_is_accepted():
    assert quiet({"moe": False, "ep_size": 1, "moe_experts": [1], "moe_type": "standard"}) \
        == {"plugins": []}
    assert quiet({"moe": {}}) == {"plugins": []}


def test_training_keys_warn_once_naming_them_all():
    config = {"train_batch_size": 8, "optimizer": {"type": "AdamW"}, "gradient_clipping": 1.0,
              "fp16": {"enabled": True, "loss_scale": 0},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
              "checkpoint": {"tag_validation": "Warn"}}
    with pytest.warns(ConfigWarning) as caught:
        out = resolve_config(config)
    assert out == {"dtype": "float16", "plugins": []}
    assert len(caught) == 1
    message = str(caught[0].message)
    for key in ("train_batch_size", "optimizer", "gradient_clipping", "fp16.loss_scale",
                "zero_optimization", "checkpoint.tag_validation", "offload-weights"):
        assert key in message


def test_tokens_and_graphs():
    assert quiet({"max_out_tokens": 512, "min_out_tokens": 16, "enable_cuda_graph": True}) == \
        {"max_seq_len": 512, "cuda_graphs": True, "plugins": []}
    assert quiet({"max_tokens": 256})["max_seq_len"] == 256
    with pytest.raises(ConfigError, match="min_tokens=300 is more than max_seq_len=256"):
        resolve_config({"max_tokens": 256, "min_tokens": 300})
    with pytest.raises(ConfigError, match="max_seq_len=128 and max_out_tokens=256"):
        resolve_config({"max_seq_len": 128, "max_out_tokens": 256})
    with pytest.raises(ConfigError, match="max_out_tokens=0 is not valid"):
        resolve_config({"max_out_tokens": 0})


def test_inference_keys_without_effect_are_silent_at_defaults_and_warned_otherwise():
    defaults = {"replace_method": "auto", "return_tuple": True, "triton_autotune": False,
                "transposed_mode": False, "set_empty_params": False, "keep_module_on_host": False,
                "save_mp_checkpoint_path": None, "zero": {}, "config": None, "training_mp_size": 1,
                "triangular_masking": True, "mpu": None, "tensor_parallel": {"tp_grain_size": 64}}
    assert quiet(defaults) == {"plugins": []}
    with pytest.warns(ConfigWarning) as caught:
        resolve_config({"return_tuple": False, "triton_autotune": True,
                        "zero": {"offload_param": {"device": "cpu"}}})
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "return_tuple=false" in message and "triton_autotune=true" in message
    assert "offload-weights" in message


@pytest.mark.parametrize("config, why", [
    ({"triangular_masking": False}, "only causal decoders"), ({"tm": False}, "only causal"),
    ({"training_mp_size": 2}, "pre-sharded for training"),
    ({"mpu": object()}, "a Python object")])
def test_refused_inference_keys(config, why):
    with pytest.raises(ConfigError, match=why):
        resolve_config(config)


def test_init_inference_shaped_python_values():
    out = quiet({"dtype": torch.half, "tensor_parallel": {"tp_size": 2},
                 "injection_policy": "LlamaForCausalLM", "replace_with_kernel_inject": True})
    assert out == {"dtype": "float16", "plugins": ["llama", "tp"], "tp_size": 2}
