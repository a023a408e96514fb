"""The infergraft hook contract.

Every ``register_*`` hook receives a ``register`` callback; a plugin calls it once per
object it provides. The core validates and de-duplicates what is registered, so a spec
can grow arguments later without breaking plugins written against an older one.
"""
import pluggy

PROJECT = "infergraft"
#: Version of this contract. A plugin declares the versions it supports as a PEP 440
#: range, ``INFERGRAFT_CONTRACT = ">=1,<2"`` (module or object attribute); one that
#: excludes this version is refused at load with an error naming it. Bumped only for an
#: incompatible change (a hook or argument removed or changing meaning): a hookspec that
#: gains an argument, or a new hook, keeps old plugins working.
CONTRACT_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def infergraft_register_policies(register):
    """Register injection policies.

    Call ``register(policy)`` with an object implementing
    :class:`infergraft.core.policy.Policy`: it claims HF architectures, turns a config
    into a ``ModelSpec`` and lists the declarative weight map.
    """


@hookspec
def infergraft_register_cache_backends(register):
    """Register KV-cache backends.

    Call ``register(backend)`` with an object implementing
    :class:`infergraft.core.cache.CacheBackend`: storage layout, allocator and the
    attention path that reads it.
    """


@hookspec
def infergraft_register_quantizers(register):
    """Register weight or K/V quantisers.

    Call ``register(quantizer)`` with an object implementing
    :class:`infergraft.core.quant.Quantizer`: packs a weight and supplies its matmul.
    """


@hookspec
def infergraft_register_planners(register):
    """Register parallel planners.

    Call ``register(planner)`` with an object implementing
    :class:`infergraft.core.plan.Planner`: turns (ModelSpec, world) into a ParallelPlan.
    """


@hookspec
def infergraft_register_layers(register):
    """Register layer implementations (layer replacement).

    Call ``register(impl)`` with a :class:`infergraft.core.layer.LayerImpl`: an
    attention, an MLP or a norm under a name a policy's ModelSpec refers to
    (``LayerSpec.attention`` / ``.mlp`` per layer, ``ModelSpec.norm``); the runner
    composes each decoder layer from them. A name is unique within its kind.
    """


@hookspec
def infergraft_prepare_plan(plan, spec):
    """Adjust the composed plan before weights load.

    ``plan`` is the frozen :class:`infergraft.core.plan.Plan`, ``spec`` the ModelSpec.
    Return a new plan (``attrs.evolve(plan, ...)``) or ``None`` to keep it; anything else
    is an error naming the plugin. Called for every implementing plugin in pluggy's
    order (the last loaded first; ``hookimpl(tryfirst=True)`` / ``trylast`` move one);
    each sees the previous one's result.
    """


@hookspec
def infergraft_register_logits_processors(register):
    """Register logits processors: per-request constraints on the next token.

    Call ``register(processor)`` with an object implementing
    :class:`infergraft.core.logits_processor.LogitsProcessor`: a request names it in
    ``SamplingParams(logits_processors={name: arg})`` and the sampler masks the tokens
    its state disallows, all constrained rows of a step in one kernel.
    """


@hookspec
def infergraft_register_proposers(register):
    """Register proposers: speculative tokens that one step of the engine verifies.

    Call ``register(proposer)`` with an object implementing
    :class:`infergraft.core.speculative.proposer.Proposer`: an engine built with
    ``speculative={"method": name, "k": ...}`` asks its ``Drafter`` each step for up to
    ``k`` tokens per request (an n-gram lookup, a draft model); the target model keeps the
    longest prefix it agrees with, so the output is the target's whatever is proposed.
    """
