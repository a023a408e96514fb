"""Conformance kit for plugins, installed with infergraft (see docs/plugins.md).

One module per plugin kind, each with group test classes and one aggregate class that a
plugin's own suite subclasses, providing a few fixtures:

* ``policy_kit.PolicyTests``          (fixtures ``policy``, ``hf_model``)
* ``cache_kit.CacheBackendTests``     (fixture ``backend``; runs ``cache_machine``)
* ``quant_kit.QuantizerTests``        (fixture ``quantizer``, weight quantisers)
* ``planner_kit.PlannerTests``        (fixture ``planner``)
* ``layer_kit.LayerTests``            (fixtures ``layer_impl``, ``spec``: an attention, MLP or norm)
* ``logits_kit.LogitsProcessorTests`` (fixtures ``processor``, ``processor_arg``, ``bad_arg``)
* ``proposer_kit.ProposerTests``      (fixtures ``proposer``, ``proposer_options``, ``bad_options``)

``strategies`` holds the public hypothesis strategies, ``models`` tiny random HF models,
``parity`` the comparisons with HF transformers, and ``fixtures`` the pytest fixtures
that the ``pytest11`` entry point loads into every test run.
"""
