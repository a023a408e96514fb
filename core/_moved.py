"""Old import paths of modules that moved (into core's sub-packages; the kernels'
micro-benchmarks into core/tools/kernel_bench/), and of names that left a module, kept
working for one release: importing one warns (DeprecationWarning) and gives the module at
its new path, the very same module object, so attributes set on either are seen by both.
``python -m`` at an old path runs the new module, with a FutureWarning.

A third party's plugin written against ``infergraft.core.cuda_graph`` or
``infergraft.core.plugins`` keeps loading; our own code imports the new paths (the
layering test refuses the old ones).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

MOVED = {
    "infergraft.core.plugins": "infergraft.core.plugin_manager",
    "infergraft.core.model": "infergraft.core.runner.model",
    "infergraft.core.sampler": "infergraft.core.runner.sampler",
    "infergraft.core.cuda_graph": "infergraft.core.runner.cuda_graph",
    "infergraft.core.prefill_graph": "infergraft.core.runner.prefill_graph",
    "infergraft.core.pipeline": "infergraft.core.runner.lookahead",
    "infergraft.core.source": "infergraft.core.loading.source",
    "infergraft.core.demo": "infergraft.core.loading.demo",
    "infergraft.core.weights": "infergraft.core.loading.weights",
    "infergraft.core.parallel": "infergraft.core.distributed.ranks",
    "infergraft.core.stages": "infergraft.core.distributed.stages",
    "infergraft.core.plan_cli": "infergraft.core.tools.plan_cli",
    "infergraft.core.bench": "infergraft.core.tools.bench",
    "infergraft.core.bench_cli": "infergraft.core.tools.bench_cli",
    "infergraft.core.bench_profile": "infergraft.core.tools.bench_profile",
    **{f"infergraft.kernels.bench.{name}": f"infergraft.core.tools.kernel_bench.{name}"
       for name in ("attention", "gemms", "int4", "read", "varlen")},
}

# names that left a module which stays: module -> {name: the module now holding it}
MOVED_NAMES = {
    "infergraft.core.quant": {"SlotPacker": "infergraft.core.loading.packing"},
    "infergraft.core.memory": {"spec_of": "infergraft.core.loading.source"},
    "infergraft.core.request": {name: "infergraft.core.prompt"
                                for name in ("as_batch", "check_request", "encode_prompt")},
    # the LLaMA layers became registered implementations (the layer-replacement hook)
    **{module: {"Norm": "infergraft.policies.llama_layers"}
       for module in ("infergraft.core.runner.layers", "infergraft.core.runner.model")},
    "infergraft.kernels": {name: "infergraft.kernels.dispatch"
                           for name in ("OPS", "get_op", "get_ops", "resolve_backend")},
}
# namespace packages among them: no __init__.py of their own to hold a ``__getattr__``,
# install() hangs one on them (so their old names resolve once infergraft.core is imported)
NAMESPACES = ("infergraft.kernels",)


def _warn(old: str, new: str, category=DeprecationWarning) -> None:
    warnings.warn(f"{old} moved to {new}; the old path goes in the next release",
                  category, stacklevel=3)


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec):
        _warn(spec.name, MOVED[spec.name])
        module = importlib.import_module(MOVED[spec.name])
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # the import system stamped the alias's spec on the module: give it back its own
        module.__spec__ = self._own_spec

    def get_code(self, fullname):
        # `python -m OLD`, where runpy asks for the code to run as __main__: code that runs
        # the new module so, under its own name (its relative imports start from its own
        # package). A command's user is told, not only its importers: a FutureWarning shows
        _warn(fullname, MOVED[fullname], FutureWarning)
        run = f"runpy.run_module({MOVED[fullname]!r}, run_name='__main__', alter_sys=True)"
        return compile(f"import runpy\n{run}\n", f"<{fullname}, moved>", "exec")


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader())


def install() -> None:
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
    for name in NAMESPACES:
        try:
            namespace = importlib.import_module(name)
        except ModuleNotFoundError as e:
            # setuptools' editable finder lists the namespace packages it saw at install
            raise ImportError(
                f"{name} is not found: this editable install was made while its folder "
                "had an __init__.py; run `pip install -e .` again in the checkout") from e
        namespace.__getattr__ = moved_names(name)


def moved_names(module_name: str):
    """A module ``__getattr__`` resolving the names that left ``module_name``."""
    table = MOVED_NAMES[module_name]

    def __getattr__(name):
        if name not in table:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        _warn(f"{module_name}.{name}", f"{table[name]}.{name}")
        return getattr(importlib.import_module(table[name]), name)

    return __getattr__
