"""Every DeepSpeed key a config may hold and what it becomes here (docs/config.md shows
this table): the fields of DeepSpeedInferenceConfig and its sub-configs
(deepspeed/inference/config.py, with their aliases), and the training config's keys."""
from __future__ import annotations

_PLAIN = "kernels=\"torch\": plain torch layers, no Triton, no fused decode layer"
_MOE = "refused: mixture-of-experts models are not supported"
_OBJECT = ("refused unless null: a Python object (a file cannot hold one); the process group "
           "is torchrun's world")
_TRAINING = "ignored (training only); one ConfigWarning names every such key found"

INFERENCE_KEYS = {
    "dtype": "dtype: fp16 / float16 / half / torch.float16 -> float16; bf16 / bfloat16 -> "
             "bfloat16; fp32 / float32 / float -> float32; int8 / torch.int8 -> float16 + "
             "plugin \"int8\" (int8 weights)",
    "fp16.enabled": "true -> dtype float16 (with bf16.enabled also true, or another dtype: "
                    "an error naming both)",
    "bf16.enabled": "true -> dtype bfloat16",
    "bfloat16.enabled": "the older spelling of bf16.enabled",
    "replace_with_kernel_inject": "true (our default) -> our fused path (kernels=\"auto\"); "
                                  "false -> " + _PLAIN,
    "kernel_inject": "alias of replace_with_kernel_inject",
    "tensor_parallel.tp_size": "N > 1 -> plugin \"tp\" + its option tp_size=N (the run must "
                               "have N processes: torchrun --nproc-per-node N); 1 -> nothing",
    "tensor_parallel.enabled": "false -> tensor_parallel.tp_size is not used",
    "tensor_parallel.tp_grain_size": "ignored, warned unless 64: tp splits heads and MLP rows "
                                     "evenly (tp_size must divide them)",
    "tensor_parallel.mpu": _OBJECT,
    "tensor_parallel.tp_group": _OBJECT,
    "tp": "alias of tensor_parallel",
    "mp_size": "the older tensor_parallel.tp_size (same mapping; DeepSpeed's model parallel "
               "is tensor parallel, unlike model_parallel_size below)",
    "tensor_parallel_size": "not DeepSpeed's (the seed text's and vLLM's name): as "
                            "tensor_parallel.tp_size; with model_parallel_size N > 1, the "
                            "ranks of each stage (pp's option tensor_parallel)",
    "model_parallel_size": "not DeepSpeed's (the seed text's name, its model parallelism being "
                           "layers split into stages): N > 1 -> plugin \"pp\" + its option "
                           "stages=N (the run must have N x tensor_parallel_size processes); "
                           "1 -> nothing",
    "pipeline_parallel_size": "alias of model_parallel_size (vLLM's name)",
    "mpu": _OBJECT,
    "enable_cuda_graph": "cuda_graphs (decode under CUDA graphs; our default: on CUDA)",
    "use_triton": "true -> kernels=\"triton\" (an error where Triton cannot run); false -> "
                  "nothing (Triton is our default on CUDA)",
    "triton_autotune": "ignored, warned if true: our launch plans are tuned tables "
                       "(docs/kernels.md), not autotuned at start-up",
    "zero": "ignored, warned unless empty (ZeRO-Inference); for weights kept in host memory "
            "our equivalent is plugin \"offload-weights\"",
    "triangular_masking": "true (causal, DeepSpeed's default) accepted; false refused: only "
                          "causal decoders are built",
    "tm": "alias of triangular_masking",
    "moe": _MOE + " (true, or an object with enabled true, ep_size > 1 or several experts); "
                  "false or {} accepted",
    "moe.enabled": _MOE,
    "moe.ep_size": _MOE + " (> 1)",
    "moe.moe_experts": _MOE + " (other than [1])",
    "moe.num_experts": "alias of moe.moe_experts",
    "moe.type": _MOE + " (other than \"standard\")",
    "moe.ep_mp_group": _OBJECT,
    "moe.ep_group": _OBJECT,
    "moe.expert_group": _OBJECT,
    "keep_module_on_host": "ignored, warned if true: weights stream to the device one "
                           "tensor at a time, nothing is kept whole on the host",
    "quant": "alias of quantization",
    "quantization.enabled": "true switches the section on: with kv_cache_quant and nothing "
                            "about weights (no bits, no weight), the K/V alone; else the "
                            "weights, plugin \"int8\" (W8A16) unless bits says 4",
    "quantization.bits": "8 -> plugin \"int8\" (a scale per output row); 4 -> plugin "
                         "\"int4\" (W4A16, a scale and zero-point per group of group_size "
                         "columns); accepted: 8 or 4",
    "quantization.group_size": "with 4 bits: int4's group_size, 32, 64 or 128 (default "
                               "128); with 8 bits ignored, warned",
    "quantization.kv_cache_quant": "true / \"int8\" / 8 -> plugin \"kv-int8\" (int8 K/V); "
                                   "\"fp8\" -> plugin \"kv-fp8\" (e4m3 K/V, our spelling); the "
                                   "contiguous, paged and offload caches store both",
    "quantization.weight.enabled": "true -> plugin \"int8\"; false -> no weight quantiser",
    "quantization.weight.num_bits": "as quantization.bits",
    "quantization.weight.group_size": "as quantization.group_size",
    "quantization.weight.q_type": "8 bits: \"symmetric\" accepted (int8 is), \"asymmetric\" "
                                  "refused; 4 bits: \"asymmetric\" accepted (int4 is), "
                                  "\"symmetric\" warned (int4's zero-points hold it)",
    "quantization.weight.q_groups": "ignored, warned unless 1: int8 keeps one scale per "
                                    "output row, int4's groups come from group_size",
    "quantization.weight.quantized_initialization": "ignored, warned unless empty: weights "
                                                    "are quantised as they load",
    "quantization.weight.post_init_quant": "ignored, warned unless empty: weights are "
                                           "quantised as they load",
    "quantization.activation.enabled": "ignored, warned if true: activations stay in dtype "
                                       "(W8A16, W4A16)",
    "quantization.activation.num_bits": "ignored with activation",
    "quantization.activation.q_type": "ignored with activation",
    "quantization.activation.q_groups": "ignored with activation",
    "quantization.qkv.enabled": "true accepted; false warned: every projection is quantised",
    "quantization_setting": "ignored, warned unless null (MoQ groups of the older "
                            "init_inference); use quantization.enabled",
    "checkpoint": "checkpoint: a directory of safetensors files, one .safetensors file, or "
                  "DeepSpeed's checkpoint JSON (a file or an object) naming safetensors files; "
                  ".bin / .pt / .pth / .ckpt refused (no pickle)",
    "checkpoint.type": "\"ds_model\" or \"bloom\" (HF key names) accepted; \"Megatron\" "
                       "refused (its key layout is not mapped)",
    "checkpoint.checkpoints": "the safetensors files, relative to base_dir, else the JSON "
                              "file's directory; a {\"tp\": ..., \"non_tp\": ...} pre-sharded "
                              "list refused",
    "checkpoint.version": "accepted, not used",
    "checkpoint.parallelization": "refused if \"tp\" (pre-sharded); every rank cuts its "
                                  "pieces from the full weights",
    "checkpoint.tp_size": "refused if > 1 (pre-sharded)",
    "checkpoint.dtype": "refused if int8 (pre-quantised); give float weights and "
                        "quantization.enabled",
    "base_dir": "the directory checkpoint's files are relative to",
    "set_empty_params": "ignored, warned if true: our modules are our own; pass the HF model "
                        "built on the meta device with checkpoint to skip its weights",
    "save_mp_checkpoint_path": "ignored, warned if set: nothing is saved; each rank cuts its "
                               "pieces from the full checkpoint as it loads",
    "checkpoint_config.checkpoint_dir": "as checkpoint",
    "checkpoint_config.base_dir": "as base_dir",
    "checkpoint_config.save_mp_checkpoint_path": "as save_mp_checkpoint_path",
    "ckpt_config": "alias of checkpoint_config",
    "return_tuple": "ignored, warned if false: the engine returns completions, not a module",
    "training_mp_size": "1 accepted; > 1 refused (a checkpoint pre-sharded for training "
                        "model parallelism is not read)",
    "replace_method": "ignored, warned unless \"auto\" (deprecated in DeepSpeed): the policy "
                      "comes from the model's architectures or injection_policy",
    "injection_policy": "a policy name (\"llama\"), an HF architecture (\"LlamaForCausalLM\") "
                        "or a layer class or its name (\"LlamaDecoderLayer\") -> that policy "
                        "in plugins; DeepSpeed's {LayerClass: (linear names)} form: the class "
                        "chooses the policy, a ConfigWarning says why the names are not needed; "
                        "the seed text's {\"transformer\": {\"policy\": \"llama\", \"type\": "
                        "\"layers\"}} form: below",
    "injection_policy.NAME.policy": "the policy (a name, an architecture or a layer class); "
                                    "NAME is a label (\"transformer\"), or a layer class or "
                                    "architecture that must then name the same policy",
    "injection_policy.NAME.type": "what the policy replaces: \"layers\" (or \"layer\", the "
                                  "default): each decoder layer whole (attention, MLP, norms "
                                  "and residual adds) becomes our fused layer, the only unit "
                                  "our policies replace; anything else (\"attention\", "
                                  "\"mlp\") refused",
    "injection_dict": "alias of injection_policy",
    "injection_policy_tuple": "a tuple of a layer class and / or linear names: the class "
                              "chooses the policy (as injection_policy), the names are warned",
    "config": "ignored, warned unless null (DeepSpeed's model config): the model's config "
              "comes from the model or its config.json",
    "args": "alias of config",
    "max_out_tokens": "max_seq_len (tokens the engine works with, prompt + output)",
    "max_tokens": "alias of max_out_tokens",
    "min_out_tokens": "checked: at most max_seq_len, else an error",
    "min_tokens": "alias of min_out_tokens",
    "transposed_mode": "ignored, warned if true: weight layouts are the policy's",
    "ep_size": _MOE + " (> 1; the older moe.ep_size)",
    "ep_group": _OBJECT,
    "expert_group": _OBJECT,
    "ep_mp_group": _OBJECT,
    "expert_mp_group": _OBJECT,
    "moe_experts": _MOE + " (other than [1]; the older moe.moe_experts)",
    "moe_type": _MOE + " (other than \"standard\"; the older moe.type)",
}

# DeepSpeed's training config (deepspeed/runtime/constants.py and the configs under it)
TRAINING_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "zero_optimization", "gradient_clipping", "steps_per_print",
    "wall_clock_breakdown", "memory_breakdown", "amp", "activation_checkpointing",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "monitor_config",
    "comms_logger", "autotuning", "elasticity", "data_efficiency", "curriculum_learning",
    "sparse_attention", "sparse_gradients", "prescale_gradients", "gradient_predivide_factor",
    "communication_data_type", "seq_parallel_communication_data_type", "disable_allgather",
    "dump_state", "vocabulary_size", "eigenvalue", "progressive_layer_drop",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "graph_harvesting",
    "data_types", "dataloader_drop_last", "pipeline", "aio", "compression_training",
    "quantize_training", "hybrid_engine", "torch_autocast", "nebula", "timers",
    "use_data_before_expert_parallelism",
)
# the training fields of fp16 / bf16 beside `enabled`
PRECISION_TRAINING = (
    "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
    "consecutive_hysteresis", "min_loss_scale", "fused_mode", "fp16_master_weights_and_grads",
    "immediate_grad_update", "check_grad_overflow",
)
# the training config's "checkpoint" object (not the inference checkpoint)
CHECKPOINT_TRAINING = ("tag_validation", "load_universal", "use_node_local_storage",
                       "parallel_write")

DEEPSPEED_KEYS = {
    **INFERENCE_KEYS,
    **{k: _TRAINING for k in TRAINING_KEYS},
    **{f"fp16.{k}": _TRAINING for k in PRECISION_TRAINING},
    **{f"bf16.{k}": _TRAINING for k in PRECISION_TRAINING if k != "auto_cast"},
    **{f"checkpoint.{k}": _TRAINING + " (the training config's checkpoint object)"
       for k in CHECKPOINT_TRAINING},
}
