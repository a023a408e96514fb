"""HF transformers' own way to run a model larger than the GPU, the baseline beside
``offload-weights`` (docs/bench/offload_weights.py calls it in the same process): the
same weights with accelerate's ``dispatch_model``, the first k decoder layers, the
embeddings, the final norm and the head on the GPU, the other layers in host memory
(``device_map`` "cpu": accelerate's hooks copy each layer's weights to the GPU as it
runs). TPOT = (the time of N + 1 greedy tokens - the time of 1) / N, the median of a few.
"""
import statistics
import time

import torch


def dispatch(hf, resident: int):
    """``hf`` (on the GPU) with layers ``resident`` and up moved to host memory and hooked."""
    from accelerate import dispatch_model

    layers = len(hf.model.layers)
    device_map = {"model.embed_tokens": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0}
    device_map.update({f"model.layers.{i}": 0 if i < resident else "cpu" for i in range(layers)})
    for i in range(resident, layers):
        hf.model.layers[i].to("cpu")
    torch.cuda.empty_cache()
    return dispatch_model(hf, device_map=device_map, main_device=0)


def _generate_seconds(hf, ids, new_tokens: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def hf_offloaded_tpot(hf, prompts: list[list[int]], new_tokens: int = 4,
                      repeats: int = 2) -> float:
    """Seconds per decode step of HF's generate on the dispatched model at this batch."""
    ids = torch.tensor(prompts, device="cuda")
    _generate_seconds(hf, ids, 1)  # warm-up
    steps = []
    for _ in range(repeats):
        one = _generate_seconds(hf, ids, 1)
        steps.append((_generate_seconds(hf, ids, new_tokens + 1) - one) / new_tokens)
    return statistics.median(steps)
