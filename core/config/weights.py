"""DeepSpeed's keys about weights: quantization (``quant``), checkpoint, base_dir,
checkpoint_config and ZeRO's parameter offload (mappers as in ``deepspeed``)."""
from __future__ import annotations

from ..errors import ConfigError
from .table import CHECKPOINT_TRAINING
from .values import boolean, section, show, subkeys, wrong


def quantization(r, key, value):
    value = section(key, value, '{"enabled": true, "bits": 8} or {"kv_cache_quant": true}')
    subkeys(r, key, value, ("enabled", "bits", "kv_cache_quant", "weight", "activation", "qkv"))
    weight = section(f"{key}.weight", value.get("weight", {}), '{"num_bits": 8}')
    subkeys(r, f"{key}.weight", weight, ("enabled", "num_bits", "q_type", "q_groups",
                                         "quantized_initialization", "post_init_quant"))
    enabled = boolean(f"{key}.enabled", value.get("enabled"), none=True)
    weight_on = boolean(f"{key}.weight.enabled", weight.get("enabled"), none=True)
    bits = [(k, v) for k, v in ((f"{key}.bits", value.get("bits")),
                                (f"{key}.weight.num_bits", weight.get("num_bits"))) if v is not None]
    asked = enabled is True or weight_on is True or (bits and enabled is None)
    if asked and enabled is not False and weight_on is not False:
        for bkey, b in bits or [(f"{key}.enabled", 8)]:
            if isinstance(b, bool) or not isinstance(b, int) or b != 8:
                why = "4-bit weights are not built yet" if b == 4 else "int8 weights only"
                raise ConfigError(f"config key {bkey}={show(b)} is not valid: {why}; "
                                  "accepted: 8")
            r.claim("weights", "int8", bkey, b)
        q_type = weight.get("q_type", "symmetric")
        if q_type not in ("symmetric", "sym"):
            raise wrong(f"{key}.weight.q_type", q_type, '"symmetric" (one scale per row)')
        r.ignored(f"{key}.weight.q_groups", weight.get("q_groups", 1), 1,
                  "one scale per output row")
        for sub in ("quantized_initialization", "post_init_quant"):
            r.ignored(f"{key}.weight.{sub}", weight.get(sub, {}), {},
                      "weights are quantised as they load")
    activation = section(f"{key}.activation", value.get("activation", {}), '{"enabled": false}')
    r.ignored(f"{key}.activation.enabled", activation.get("enabled", False), False,
              "activations stay in dtype: W8A16")
    qkv = section(f"{key}.qkv", value.get("qkv", {}), '{"enabled": true}')
    r.ignored(f"{key}.qkv.enabled", qkv.get("enabled", True), True,
              "every projection is quantised alike")
    kv = value.get("kv_cache_quant")
    if kv is True or kv == "int8" or (kv == 8 and not isinstance(kv, bool)):
        r.claim("kv", "int8", f"{key}.kv_cache_quant", kv)
    elif kv == "fp8":
        r.claim("kv", "fp8", f"{key}.kv_cache_quant", kv)
    elif kv not in (None, False):
        raise wrong(f"{key}.kv_cache_quant", kv,
                    'true, "int8" or 8 (int8 K/V), "fp8" (e4m3 K/V), or false')


def checkpoint(r, key, value):
    if value is None or value == "":
        return
    if isinstance(value, dict) and value and set(value) <= set(CHECKPOINT_TRAINING):
        r.training.extend(f"{key}.{k}" for k in value)  # the training config's object
        return
    r.claim("checkpoint", value, key)


def base_dir(r, key, value):
    if value in (None, ""):
        return
    if not isinstance(value, str):
        raise wrong(key, value, "a directory path")
    r.claim("base_dir", value, key)


def checkpoint_config(r, key, value):
    value = section(key, value, '{"checkpoint_dir": "path"}')
    subkeys(r, key, value, ("checkpoint_dir", "base_dir", "save_mp_checkpoint_path"))
    checkpoint(r, f"{key}.checkpoint_dir", value.get("checkpoint_dir"))
    base_dir(r, f"{key}.base_dir", value.get("base_dir"))
    save_path(r, f"{key}.save_mp_checkpoint_path", value.get("save_mp_checkpoint_path"))


def save_path(r, key, value):
    r.ignored(key, value, None, "nothing is saved: each rank cuts its pieces from the full "
                                "checkpoint as it loads")


def zero(r, key, value):
    hint = offload_hint(key, value)
    r.ignored(key, value, {}, "ZeRO-Inference is not built" + (f"; {hint}" if hint else ""))


def offload_hint(key, value):
    """For ZeRO's parameter offload: the plugin that keeps weights in host memory here."""
    offload = value.get("offload_param") if isinstance(value, dict) else None
    device = offload.get("device") if isinstance(offload, dict) else None
    if device in ("cpu", "nvme"):
        return (f"{key}.offload_param.device={show(device)}: our equivalent is the planner "
                "plugin offload-weights (plugins=[\"offload-weights\"])")
    return None
