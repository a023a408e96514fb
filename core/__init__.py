"""infergraft core: hook contract, plugin manager, build(), Engine.

    from infergraft import core
    engine = core.build(model, plugins=["paged", "int8"], dtype="bfloat16")
"""
from . import _moved

_moved.install()  # old paths of moved modules (infergraft.core.cuda_graph, ...) still import

from .build import build  # noqa: E402
from .engine import Engine
from .errors import (InfergraftError, InvalidRequestError, KernelUnavailableError, PlanError,
                     PluginError, RankFailedError, RequestFailedError, UnknownPluginError,
                     UnsupportedModelError, WeightLoadError)
from .hookspecs import CONTRACT_VERSION, hookimpl
from .compat.init_inference import init_inference
from .plugin_manager import DEFAULT_PLUGINS, get_plugin_manager, reset_plugin_manager
from .request import Completion, SamplingParams
from .spec import ModelSpec, RopeSpec

__all__ = [
    "build", "Engine", "Completion", "SamplingParams", "ModelSpec", "RopeSpec", "hookimpl",
    "CONTRACT_VERSION", "DEFAULT_PLUGINS", "get_plugin_manager", "reset_plugin_manager",
    "InfergraftError", "InvalidRequestError", "KernelUnavailableError", "PlanError",
    "PluginError", "RankFailedError", "RequestFailedError", "UnknownPluginError",
    "UnsupportedModelError", "WeightLoadError", "init_inference",
]
