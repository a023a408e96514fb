"""DeepSpeed's keys about weights: quantization (``quant``), checkpoint, base_dir,
checkpoint_config and ZeRO's parameter offload (mappers as in ``deepspeed``)."""
from __future__ import annotations

from .table import CHECKPOINT_TRAINING
from .values import boolean, section, show, subkeys, wrong


def quantization(r, key, value):
    value = section(key, value, '{"enabled": true, "bits": 8} or {"kv_cache_quant": true}')
    subkeys(r, key, value, ("enabled", "bits", "group_size", "kv_cache_quant", "weight",
                            "activation", "qkv"))
    weight = section(f"{key}.weight", value.get("weight", {}), '{"num_bits": 8}')
    subkeys(r, f"{key}.weight", weight, ("enabled", "num_bits", "group_size", "q_type",
                                         "q_groups", "quantized_initialization",
                                         "post_init_quant"))
    enabled = boolean(f"{key}.enabled", value.get("enabled"), none=True)
    weight_on = boolean(f"{key}.weight.enabled", weight.get("enabled"), none=True)
    bits = [(k, v) for k, v in ((f"{key}.bits", value.get("bits")),
                                (f"{key}.weight.num_bits", weight.get("num_bits"))) if v is not None]
    kv_on = value.get("kv_cache_quant") not in (None, False)
    # `enabled` switches the section on; what it quantises is what the section names: with
    # kv_cache_quant and nothing about weights, the K/V alone (the seed's {"enabled": true,
    # "kv_cache_quant": true} beside fp16 weights), else the weights
    asked = weight_on is True or (bits and enabled is None) or (
        enabled is True and (bits or "weight" in value or not kv_on))
    if asked and enabled is not False and weight_on is not False:
        _weights(r, key, value, weight, bits or [(f"{key}.enabled", 8)])
    activation = section(f"{key}.activation", value.get("activation", {}), '{"enabled": false}')
    r.ignored(f"{key}.activation.enabled", activation.get("enabled", False), False,
              "activations stay in dtype: weight-only quantisation")
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


def _weights(r, key, value, weight, bits):
    """Weight quantisation: 8 bits -> plugin int8 (one scale per output row), 4 bits ->
    plugin int4 (a scale and zero-point per group of group_size columns)."""
    for bkey, b in bits:
        if isinstance(b, bool) or b not in (4, 8):
            from infergraft.kernels.int4_linear import GROUP_SIZES

            raise wrong(bkey, b, f"8 (int8 weights, W8A16) or 4 (int4 weights in groups of "
                                 f"{', '.join(map(str, GROUP_SIZES))} columns, W4A16)")
        r.claim("weights", "int8" if b == 8 else "int4", bkey, b)
    four = bits[0][1] == 4
    sizes = [(k, v) for k, v in ((f"{key}.group_size", value.get("group_size")),
                                 (f"{key}.weight.group_size", weight.get("group_size")))
             if v is not None]
    for gkey, size in sizes:
        if four:
            r.claim("group_size", _group_size(r, gkey, size), gkey)
        else:
            r.ignored(gkey, size, None, "int8 keeps one scale per output row")
    q_type = weight.get("q_type")
    if four and q_type in ("symmetric", "sym"):
        r.ignored(f"{key}.weight.q_type", q_type, None,
                  "int4 keeps a zero-point per group (asymmetric), which holds symmetric "
                  "groups too")
    elif not four and q_type not in (None, "symmetric", "sym"):
        raise wrong(f"{key}.weight.q_type", q_type, '"symmetric" (one scale per row)')
    elif four and q_type not in (None, "asymmetric", "asym"):
        raise wrong(f"{key}.weight.q_type", q_type, '"asymmetric" (a zero-point per group)')
    r.ignored(f"{key}.weight.q_groups", weight.get("q_groups", 1), 1,
              f"{key}.group_size sets int4's groups" if four else "one scale per output row")
    for sub in ("quantized_initialization", "post_init_quant"):
        r.ignored(f"{key}.weight.{sub}", weight.get(sub, {}), {},
                  "weights are quantised as they load")


def _group_size(r, key, size) -> int:
    from infergraft.kernels.int4_linear import GROUP_SIZES  # not at import: it imports triton

    if isinstance(size, bool) or size not in GROUP_SIZES:
        default = r.pm.quantizers().get("int4").options["group_size"]
        raise wrong(key, size, f"{', '.join(map(str, GROUP_SIZES))} (the columns sharing one "
                               f"scale and zero-point; default {default})")
    return size


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
