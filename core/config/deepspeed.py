"""DeepSpeed's inference keys mapped onto ``core.build``'s arguments and plugins.

Each mapper takes (resolution, key, value) and records what the key asks for in the
``Resolution``; nothing is decided until every key is read (``core.config.resolve_config``).
What each key becomes: ``table.DEEPSPEED_KEYS`` (docs/config.md)."""
from __future__ import annotations

from ..errors import ConfigError
from .table import PRECISION_TRAINING
from .parallel import PARALLEL_MAPPERS
from .values import (boolean, dtype_name, find_policy, no_object, positive_int, section, show,
                     subkeys, wrong)
from .weights import base_dir, checkpoint, checkpoint_config, quantization, save_path, zero

MOE = "mixture-of-experts models are not supported (no policy builds expert layers)"
INJECTION_FORMS = ("a policy name (\"llama\"), an HF architecture (\"LlamaForCausalLM\"), a "
                   "layer class name (\"LlamaDecoderLayer\"), DeepSpeed's {LayerClass: "
                   "(linear names)}, or {\"transformer\": {\"policy\": \"llama\", \"type\": "
                   "\"layers\"}}")
# what an injection_policy entry's "type" may say it replaces: our policies replace each
# decoder layer whole (attention, MLP, norms and residual adds, fused), nothing smaller
INJECTION_TYPES = ("layers", "layer")
TYPE_MEANS = ("\"type\" says what the policy replaces: \"layers\", each decoder layer whole "
              "(attention, MLP, norms and residual adds become our fused layer), the only unit "
              "our policies replace; a part alone (attention or MLP) is not built")


def dtype(r, key, value):
    name = dtype_name(key, value)
    if name == "int8":  # DeepSpeed's int8: quantised weights, float16 activations
        r.flags["int8 dtype"] = key
        r.claim("weights", "int8", key, value)
    else:
        r.claim("dtype", name, key, value)


def precision(r, key, value):
    """fp16 / bf16 / bfloat16: {"enabled": true} chooses the dtype; the rest is training's."""
    value = section(key, value, '{"enabled": true}')
    for sub in value:
        if sub in PRECISION_TRAINING:
            r.training.append(f"{key}.{sub}")
    subkeys(r, key, value, ("enabled", *PRECISION_TRAINING))
    if boolean(f"{key}.enabled", value.get("enabled", False)):
        r.claim("dtype", "float16" if key == "fp16" else "bfloat16", f"{key}.enabled", True)


def kernel_inject(r, key, value):
    if boolean(key, value):
        r.flags["fused"] = key  # our default; only kernels="torch" contradicts it
    else:
        r.claim("kernels", "torch", key, False)


def use_triton(r, key, value):
    if boolean(key, value):
        r.claim("kernels", "triton", key, True)


def injection_policy(r, key, value):
    if value is None:
        return
    if isinstance(value, (str, type)):
        name = value if isinstance(value, str) else value.__name__
        r.claim("policy", find_policy(r.pm, key, name), key, name)
        return
    if not isinstance(value, dict) or not value:
        raise wrong(key, value, INJECTION_FORMS)
    for cls, linears in value.items():
        name = cls.__name__ if isinstance(cls, type) else cls
        if not isinstance(name, str):
            raise wrong(key, value, "an object whose keys are layer classes or their names")
        if isinstance(linears, dict):
            _policy_entry(r, f"{key}.{name}", name, linears)
            continue
        r.claim("policy", find_policy(r.pm, key, name), key, name)
        _explain_linears(r, key, name, linears)


def _policy_entry(r, key, label, entry):
    """The form {"transformer": {"policy": "llama", "type": "layers"}}: ``policy`` names
    the policy, ``type`` what it replaces; the outer key is a label, or a layer class or
    architecture that must then agree with ``policy``."""
    subkeys(r, key, entry, ("policy", "type"))
    name = entry.get("policy")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"config key {key}.policy={show(name)} is not valid; accepted: a "
                          f"policy name such as \"llama\" (or an HF architecture or layer "
                          f"class), as in {{{show(label)}: {{\"policy\": \"llama\", "
                          f"\"type\": \"layers\"}}}}")
    kind = entry.get("type", "layers")
    if kind not in INJECTION_TYPES:
        raise ConfigError(f"config key {key}.type={show(kind)} is not valid; accepted: "
                          f"{' or '.join(map(show, INJECTION_TYPES))}. {TYPE_MEANS}")
    r.claim("policy", find_policy(r.pm, f"{key}.policy", name), f"{key}.policy", name)
    named = find_policy(r.pm, key, label, quiet=True)  # "transformer" names none: a label
    if named is not None:
        r.claim("policy", named, key, label)


def injection_policy_tuple(r, key, value):
    if value is None:
        return
    items = value if isinstance(value, (list, tuple)) else [value]
    names = [v.__name__ if isinstance(v, type) else v for v in items]
    if not names or not all(isinstance(n, str) for n in names):
        raise wrong(key, value, "a layer class (or its name) and / or linear names")
    found = [(n, find_policy(r.pm, key, n, quiet=True)) for n in names]
    for name, policy in found:
        if policy is not None:
            r.claim("policy", policy, key, name)
    linears = [n for n, policy in found if policy is None]
    if linears:
        _explain_linears(r, key, None, linears)


def _explain_linears(r, key, name, linears):
    if linears in (None, (), []):
        return
    shown = show(list(linears) if isinstance(linears, (list, tuple)) else linears)
    chosen = f"the policy of {name} is used; " if name else ""
    r.explained.append(
        f"config key {key}: {chosen}the module names {shown} are not needed: our policies "
        "know where tensor parallelism all-reduces (after the attention output projection o "
        "and the MLP's down projection), so they are ignored")


def cuda_graphs(r, key, value):
    r.claim("cuda_graphs", boolean(key, value), key)


def max_tokens(r, key, value):
    r.claim("max_seq_len", positive_int(key, value), key)


def min_tokens(r, key, value):
    r.claim("min_out_tokens", positive_int(key, value), key)


def moe(r, key, value):
    if isinstance(value, bool) or value is None:
        on = bool(value)
    else:
        value = section(key, value, "false")
        on = boolean(f"{key}.enabled", value.get("enabled", False)) or _more_than_one(
            value.get("ep_size", 1)) or _experts(value.get("moe_experts", value.get(
                "num_experts", [1]))) or value.get("type", "standard") != "standard"
    if on:
        raise ConfigError(f"config key {key}={show(value)}: {MOE}; remove it")


def moe_field(r, key, value):
    on = {"ep_size": lambda v: _more_than_one(v), "moe_experts": _experts,
          "moe_type": lambda v: v not in (None, "standard")}[key](value)
    if on:
        raise ConfigError(f"config key {key}={show(value)}: {MOE}; remove it")


def _experts(v) -> bool:
    return v not in (None, 1, [1], (1,))


def _more_than_one(v) -> bool:
    return not isinstance(v, (int, float)) or isinstance(v, bool) or v > 1


def objects(r, key, value):
    no_object(key, value)


def triangular_masking(r, key, value):
    if not boolean(key, value):
        raise ConfigError(f"config key {key}=false is refused: only causal decoders are built; "
                          "accepted: true")


def training_mp_size(r, key, value):
    if positive_int(key, value) > 1:
        raise ConfigError(f"config key {key}={value} is refused: checkpoints pre-sharded for "
                          "training model parallelism are not read; give the full HF "
                          "safetensors weights (every rank cuts its own pieces); accepted: 1")


def _ignore(default, why):
    return lambda r, key, value: r.ignored(key, value, default, why)


MAPPERS = {
    "dtype": dtype, "fp16": precision, "bf16": precision, "bfloat16": precision,
    "replace_with_kernel_inject": kernel_inject, "kernel_inject": kernel_inject,
    "use_triton": use_triton, **PARALLEL_MAPPERS, "mpu": objects,
    "injection_policy": injection_policy,
    "injection_dict": injection_policy, "injection_policy_tuple": injection_policy_tuple,
    "enable_cuda_graph": cuda_graphs, "max_out_tokens": max_tokens, "max_tokens": max_tokens,
    "min_out_tokens": min_tokens, "min_tokens": min_tokens, "quantization": quantization,
    "quant": quantization, "checkpoint": checkpoint, "base_dir": base_dir,
    "checkpoint_config": checkpoint_config, "ckpt_config": checkpoint_config,
    "save_mp_checkpoint_path": save_path, "moe": moe, "ep_size": moe_field,
    "moe_experts": moe_field, "moe_type": moe_field, "ep_group": objects,
    "expert_group": objects, "ep_mp_group": objects, "expert_mp_group": objects,
    "triangular_masking": triangular_masking, "tm": triangular_masking,
    "training_mp_size": training_mp_size, "zero": zero,
    "replace_method": _ignore("auto", "deprecated in DeepSpeed; the policy comes from the "
                                      "model's architectures or injection_policy"),
    "return_tuple": _ignore(True, "the engine returns completions, not a module"),
    "triton_autotune": _ignore(False, "our launch plans are tuned tables (docs/kernels.md)"),
    "transposed_mode": _ignore(False, "weight layouts are the policy's"),
    "set_empty_params": _ignore(False, "our modules are our own; pass the HF model built on "
                                       "the meta device with checkpoint"),
    "keep_module_on_host": _ignore(False, "weights stream to the device one tensor at a time"),
    "config": _ignore(None, "the model's config comes from the model or its config.json"),
    "args": _ignore(None, "the model's config comes from the model or its config.json"),
    "quantization_setting": _ignore(None, "use quantization.enabled"),
}
