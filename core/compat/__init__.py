"""Scripts written for other engines, run on ours: DeepSpeed's ``init_inference`` and HF
transformers' ``generate`` / forward calls (docs/from-deepspeed.md)."""
