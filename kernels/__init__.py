"""Triton kernels, one op per file, each beside its plain-torch reference."""
if __name__ == "kernels":
    # This folder imported as a top-level `kernels`: a checkout's root is on sys.path
    # (`python -m` / `-c` run there) and hides the installed package of that name, Hugging
    # Face's, which transformers imports. Say so, rather than fail on a name it lacks.
    import importlib.metadata

    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        raise ImportError(
            "`import kernels` found infergraft's kernels/ folder (infergraft.kernels), not "
            "the installed `kernels` package that transformers imports, because this "
            "checkout's root is on sys.path. Run Python from another directory, or with "
            "`python -P` (PYTHONSAFEPATH=1), which leaves the working directory off sys.path.")

from .dispatch import OPS, get_op, get_ops, resolve_backend

__all__ = ["OPS", "get_op", "get_ops", "resolve_backend"]
