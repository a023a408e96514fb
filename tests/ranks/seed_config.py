"""One rank of tests/test_config_torchrun.py, started by torchrun: the seed's DeepSpeed
config (tests/data/seed_ds_config.json) as written around a model directory, the same
config without its K/V quantisation, the config in this process alone (no tensor
parallelism), and its two ranks as pipeline stages instead (model_parallel_size 2, 4
micro-batches); rank 0 writes plans, logits and greedy tokens as JSON.

    torchrun --nproc-per-node 2 tests/ranks/seed_config.py MODEL_DIR CONFIG OUT PROMPTS"""
import json
import os
import sys

from infergraft import core
from infergraft.core.config import load_config

model_dir, config, out, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
as_written = load_config(config)
alone = {k: v for k, v in as_written.items() if k != "tensor_parallel"}
runs = {"seed": as_written,
        "float_kv": {k: v for k, v in as_written.items() if k != "quantization"},
        "alone": alone,
        "stages": {**alone, "model_parallel_size": 2, "micro_batches": 4}}
results = {}
for name, cfg in runs.items():
    engine = core.build(model_dir, config=cfg, device="cpu")
    plan = engine.plan
    results[name] = {
        "tokens": [c.token_ids for c in engine.generate(prompts, max_new_tokens=10)],
        "logits": [engine.logits(ids).tolist() for ids in prompts],
        "dtype": plan.dtype, "kv_dtype": plan.kv_dtype, "planner": plan.planner,
        "policy": plan.policy, "tensor_parallel": plan.parallel.tensor_parallel,
        "world_size": plan.parallel.world_size, "stages": len(plan.parallel.stages),
        "micro_batches": plan.parallel.micro_batches}
    del engine
if os.environ["RANK"] == "0":
    with open(out, "w") as f:
        json.dump(results, f)
