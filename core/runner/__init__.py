"""The model runner: one forward step of a scheduled batch, eager or replayed.

``model_runner.ModelRunner`` runs a step through ``model.DecoderModel`` (our fused module
tree) or replays it from a CUDA graph (``cuda_graph``: decode per batch bucket;
``prefill_graph``: one fresh prompt per length bucket); ``lookahead`` launches a greedy
decode step before the previous one is read, ``async_steps`` any greedy step (mixed ones
too) with its decode rows fed on the device; ``sampler`` turns logits into tokens.
"""
