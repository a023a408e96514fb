"""infergraft plugins for the Qwen families, one module a family and one plugin each
(entry points in group ``infergraft``, exactly as a third party registers):

* ``qwen2`` (``infergraft_qwen.qwen2``): the ``Qwen2ForCausalLM`` policy, LLaMA-shaped
  with a bias on q, k and v: no modelling code of its own.
* ``qwen3`` (``infergraft_qwen.qwen3``): the ``Qwen3ForCausalLM`` policy and the layer it
  needs, an attention with a per-head RMSNorm on q and k, registered through
  ``infergraft_register_layers`` (the layer-replacement hook) from this package.
* ``qwen3_moe`` (``infergraft_qwen.qwen3_moe``): the ``Qwen3MoeForCausalLM`` policy, Qwen3's
  attention above and infergraft's built-in mixture-of-experts MLP (``moe``), composed by
  name; dense layers between the sparse ones where the config says so.
"""
__version__ = "0.2.0"
