"""Hugging Face hub ids (``org/name``), read from the local Hugging Face cache only.

``core.build("HuggingFaceTB/SmolLM2-135M-Instruct")`` loads the snapshot that ``hf download``
or transformers left in the cache (``models--org--name/snapshots/<commit>/``, the commit
``refs/main`` names, or the ``revision`` asked for), as transformers and vLLM do with
``HF_HUB_OFFLINE=1``. infergraft never downloads, so it never waits on the network: a model
not in the cache is an error saying how to fetch it or point at a directory."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

# org/name as the hub spells repositories: letters, digits, "-", "_", "." on each side
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(name: str) -> bool:
    return HUB_ID.fullmatch(name) is not None


def hub_cache() -> Path:
    """The cache huggingface_hub reads: ``HF_HUB_CACHE``, else ``HF_HOME``/hub, else its
    default (~/.cache/huggingface/hub). Read now, not when huggingface_hub was imported."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cached_snapshot(repo_id: str, revision: Optional[str] = None) -> tuple[Optional[Path], str]:
    """(the snapshot directory of ``repo_id`` at ``revision`` (default "main") in the
    cache, "") or (None, why it is not there)."""
    from huggingface_hub import errors, snapshot_download

    cache = hub_cache()
    try:  # local_files_only: refs/<revision> or snapshots/<commit>, no request made
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                      local_files_only=True)), ""
    except (OSError, ValueError) as e:  # not cached, incomplete, an id the hub refuses
        folder = cache / f"models--{repo_id.replace('/', '--')}"
        incomplete = getattr(errors, "IncompleteSnapshotError", ())  # huggingface_hub 1.x: none
        if not folder.is_dir():
            return None, f"the Hugging Face cache ({cache}) holds no snapshot of it"
        if isinstance(e, errors.LocalEntryNotFoundError) and not isinstance(e, incomplete):
            refs = sorted(p.name for p in (folder / "refs").glob("*"))
            return None, (f"the Hugging Face cache ({cache}) has no snapshot of revision "
                          f"{revision or 'main'!r} (its refs: {', '.join(refs) or 'none'})")
        return None, " ".join(str(e).split())


def not_cached_advice(repo_id: str) -> str:
    """How to get ``repo_id`` where infergraft will find it."""
    return (f"infergraft does not reach the hub (it loads offline, from the cache only): "
            f"download it where the hub is reachable, e.g. `hf download {repo_id}` (into that "
            f"cache; HF_HUB_CACHE or HF_HOME choose it) or `hf download {repo_id} --local-dir "
            f"DIR`, then pass the directory (--model DIR, core.build(DIR))")
