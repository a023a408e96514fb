"""K/V memory under a sliding window: our paged pool (default size) vs HF's cache, one run."""
import torch
from infergraft import core
from infergraft.core.testing.models import random_model, random_prompt, tiny_mistral_config
from infergraft.plugins.block_allocator import blocks_for

W, L, B, NEW = 64, 512, 8, 16
hf = random_model(tiny_mistral_config(sliding_window=W), seed=1)
eng = core.build(hf, plugins=["paged"], max_seq_len=L, max_batch_size=B, block_size=16)
c = eng.cache
per_block = sum(t[0].numel() * t.element_size() for t in c.k + c.v)
ours = c.allocator.num_blocks * per_block
old = B * blocks_for(L, 16) * per_block
prompts = [random_prompt(L - NEW, 256, i) for i in range(B)]
got = eng.generate(prompts, max_new_tokens=NEW)
ids = torch.tensor(prompts)
out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                  do_sample=False, return_dict_in_generate=True, pad_token_id=0)
pkv = out.past_key_values  # the Cache object HF generate returns
hf_bytes = sum(t.numel() * t.element_size() for layer in pkv.layers for t in (layer.keys, layer.values))
print(f"window {W}, max_seq_len {L}, batch {B}, prompts {L - NEW} + {NEW} new tokens, float32")
print(f"ours, paged pool (default, held whole): {ours / 2**20:.2f} MiB ({c.allocator.num_blocks} blocks); "
      f"before this session's sizing: {old / 2**20:.2f} MiB; HF cache after generate: {hf_bytes / 2**20:.2f} MiB; "
      f"same tokens as HF: {[g.token_ids for g in got] == out.sequences[:, L - NEW:].tolist()}")
