"""Triton's interpreter without its cost per helper call, for the CPU runs of the kernels.

Each call of a ``@triton.jit`` helper from a kernel (``InterpretedFunction.__call__``)
patches ``triton.language`` for the interpreter again (``_patch_lang``: every member of
``tl``, ``tl.tensor`` and ``tl.math`` listed and tested), though the kernel's launch
(``GridExecutor``) has patched the same modules and undoes it only when its grid is done.
A GEMM's program calls its helpers once a K step, so much of a step's time went there.
Here a helper call patches only a language module its launch has not patched yet: the
same patches, once a launch, the kernels' results unchanged. Where Triton's interpreter
lacks these internals (another version), nothing is changed."""
import inspect
import os
import threading

# the statements of InterpretedFunction.__call__ (Triton 3.6 to 3.9) that ``install`` replaces
UPSTREAM_CALL = ["def __call__(self, *args, **kwargs):", "_patch_lang(self.fn)",
                 "fn = self.rewrite()", "try:", "return fn(*args, **kwargs)",
                 "except Exception as e:", "raise InterpreterError(repr(e)) from e"]
_state = threading.local()  # this thread's launches in flight: the modules each patched


def install() -> bool:
    """Replace the two methods (once a process); whether it did.
    INFERGRAFT_PLAIN_INTERPRETER=1: never (Triton's interpreter as it is)."""
    if os.environ.get("INFERGRAFT_PLAIN_INTERPRETER") == "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    grid, helper = interpreter.GridExecutor, interpreter.InterpretedFunction
    if getattr(helper, "_patches_once_a_launch", False):
        return True
    if not all(callable(getattr(owner, name, None)) for owner, name in (
            (interpreter, "_patch_lang"), (grid, "__call__"), (helper, "rewrite"))) or \
            _body(helper.__call__) != UPSTREAM_CALL:
        return False
    languages = {}  # id(fn) -> (fn, ids of the language modules its globals name)

    def languages_of(fn) -> frozenset:
        if id(fn) not in languages:
            languages[id(fn)] = (fn, frozenset(
                id(v) for v in fn.__globals__.values()
                if inspect.ismodule(v) and (v is tl or v is tl.core)))
        return languages[id(fn)][1]

    launch = grid.__call__

    def launch_once_patched(self, *args, **kwargs):
        stack = _state.__dict__.setdefault("stack", [])
        stack.append(set(languages_of(self.fn)))  # what the launch itself patches
        try:
            return launch(self, *args, **kwargs)
        finally:
            stack.pop()

    def call(self, *args, **kwargs):
        # UPSTREAM_CALL, _patch_lang only for what is new to the launch
        stack, wanted = getattr(_state, "stack", None), languages_of(self.fn)
        if not (stack and wanted and wanted <= stack[-1]):
            interpreter._patch_lang(self.fn)
            if stack:
                stack[-1] |= wanted
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    grid.__call__ = launch_once_patched
    helper.__call__ = call
    helper._patches_once_a_launch = True
    return True


def _body(method) -> list[str]:
    try:
        lines = inspect.getsource(method).splitlines()
    except (OSError, TypeError):
        return []
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
