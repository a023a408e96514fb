"""The parallel keys of a config: DeepSpeed's ``tensor_parallel`` / ``mp_size``, and the
sizes the seed text names (``tensor_parallel_size``, ``model_parallel_size``), mapped onto
the ``tp`` and ``pp`` planners and their options.

"Model parallel" means two things in the field. DeepSpeed's ``mp_size`` is its older name
for the tensor-parallel size; the seed (and GPipe's vocabulary) calls splitting the layers
into stages model parallelism, "TP=2 + MP=2" being 2 x 2 processes. So ``mp_size`` stays
DeepSpeed's (``tp``) and ``model_parallel_size`` (or vLLM's ``pipeline_parallel_size``)
counts pipeline stages (``pp``, each stage split over ``tensor_parallel_size`` ranks)."""
from __future__ import annotations

from .values import boolean, no_object, positive_int, section, subkeys


def tensor_parallel(r, key, value):
    if isinstance(value, int) and not isinstance(value, bool) and key == "tensor_parallel":
        r.claim("tensor_parallel", value, key)  # the "pp" planner's option of that name
        return
    value = section(key, value, '{"tp_size": 2}')
    subkeys(r, key, value, ("enabled", "tp_size", "tp_grain_size", "mpu", "tp_group"))
    for obj in ("mpu", "tp_group"):
        no_object(f"{key}.{obj}", value.get(obj))
    if "tp_grain_size" in value:
        r.ignored(f"{key}.tp_grain_size", value["tp_grain_size"], 64,
                  "tp splits heads and MLP rows evenly")
    if boolean(f"{key}.enabled", value.get("enabled", True)) and "tp_size" in value:
        size = positive_int(f"{key}.tp_size", value["tp_size"])
        r.claim("tp_size", size, f"{key}.tp_size")
        r.flags["tp"] = f"{key}.tp_size"


def tp_size(r, key, value):
    """``mp_size`` (DeepSpeed's older tp_size) and ``tensor_parallel_size``."""
    r.claim("tp_size", positive_int(key, value), key)
    r.flags["tp"] = key


def stages(r, key, value):
    """``model_parallel_size`` / ``pipeline_parallel_size``: pipeline stages."""
    r.claim("pipeline_stages", positive_int(key, value), key)


def decide_parallel(r, out: dict) -> list[str]:
    """The planner plugin the parallel keys ask for (a list of at most one name). Stages
    > 1: ``pp``, its options ``stages`` and, with a tensor-parallel size > 1,
    ``tensor_parallel`` (each stage over that many ranks) claimed for the caller to pass
    on; else a tensor-parallel size > 1: ``tp``, its ``tp_size`` set in ``out``."""
    tp, n = r.value("tp_size"), r.value("pipeline_stages")
    if n is not None and n > 1:  # pp's own options, so that a key naming one is checked
        r.claim("stages", n, r.key_of("pipeline_stages"))
        if tp is not None and tp > 1:
            r.claim("tensor_parallel", tp, r.key_of("tp_size"))
        return ["pp"]
    if tp is not None and "tp" in r.flags and tp > 1:
        out["tp_size"] = tp
        return ["tp"]
    if tp is not None and any(k == "tp_size" for k, _, _ in r.claims["tp_size"]):
        out["tp_size"] = tp  # given as the tp planner's option itself
    return []


PARALLEL_MAPPERS = {
    "tensor_parallel": tensor_parallel, "tp": tensor_parallel, "mp_size": tp_size,
    "tensor_parallel_size": tp_size, "model_parallel_size": stages,
    "pipeline_parallel_size": stages,
}
