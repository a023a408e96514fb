"""Every error infergraft raises on purpose derives from InfergraftError."""


class InfergraftError(Exception):
    """Base class: catch this to handle any infergraft failure."""


class UnsupportedModelError(InfergraftError, ValueError):
    """No registered policy supports the model (the message lists those that exist)."""


class UnknownPluginError(InfergraftError, ValueError):
    """A plugin name was asked for that nothing registered."""


class PluginError(InfergraftError):
    """A plugin misbehaved: raised inside a hook, or registered something invalid."""

    def __init__(self, plugin: str, hook: str, message: str):
        self.plugin, self.hook = plugin, hook
        super().__init__(f"plugin {plugin!r} failed in hook {hook!r}: {message}")


class InvalidRequestError(InfergraftError, ValueError):
    """A generation request is malformed; the engine and other requests are unaffected."""


class RequestFailedError(InfergraftError, RuntimeError):
    """A request failed while running (e.g. its logits held NaN); the others ran on.

    ``completions``: from ``generate``, one Completion per prompt (and sample), in order,
    the failed ones with ``finish_reason == "error"``; None from ``stream``."""

    def __init__(self, message: str, completions=None):
        super().__init__(message)
        self.completions = completions


class PlanError(InfergraftError, ValueError):
    """The requested configuration cannot be built (does not fit, does not divide, ...)."""


class WeightLoadError(InfergraftError, ValueError):
    """Weights do not match the policy's weight map (missing, unexpected, wrong shape)."""


class KernelUnavailableError(InfergraftError, RuntimeError):
    """An explicitly requested kernel backend cannot run here."""


class ConfigError(PlanError):
    """A config (``core.build(config=...)``, ``--config``) is unreadable or holds a key
    whose value cannot be built; the message names the key, the value and what is accepted."""


class ConfigWarning(UserWarning):
    """A config key that is ignored: training-only, unknown (the closest known key named),
    or with no effect here (docs/config.md says why)."""


class QuantizedCheckpointError(WeightLoadError):
    """A pre-quantised checkpoint (GPTQ, AWQ, fp8: ``core/loading/``) in a form infergraft's
    packed formats cannot hold; the message names the key, its value and what is accepted."""


class QuantizeError(InfergraftError, ValueError):
    """``infergraft quantize`` (``core.quantize``) was asked for something it cannot do: a
    setting, a model or an output directory; the message says what is accepted."""


class PerformanceWarning(UserWarning):
    """What was asked for runs here on a slow path (fp8 weights on the CPU or on a GPU
    without fp8: the reference, dequantise then the float GEMM); results are unaffected."""


class RankFailedError(InfergraftError, RuntimeError):
    """A step across processes (``tp`` / ``pp``) stopped because a rank failed: it raised
    (its message recorded in the process group's store), its process is gone, or it did
    not answer within the collective timeout (``distributed/failure.py``). Every rank
    raises it; the process group is left, so this engine cannot step any more.

    ``ranks``: the ranks named, ``reasons``: rank -> what was recorded or seen of it,
    ``world_size``: the group's size."""

    def __init__(self, message: str, ranks=(), reasons=None, world_size: int = 0):
        super().__init__(message)
        self.ranks, self.reasons = tuple(ranks), dict(reasons or {})
        self.world_size = world_size
