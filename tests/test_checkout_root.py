"""Python run at the checkout's root, as users and scripts run it: the root is then first
on sys.path, and its folders (kernels/, core/, ...) must not hide installed packages of
those names. transformers 5.25+ imports Hugging Face's ``kernels``."""
import json
import os
import subprocess
import sys
from pathlib import Path

from infergraft.core.testing.models import tiny_llama_config

ROOT = Path(__file__).resolve().parents[1]


def run_at_root(*args: str) -> subprocess.CompletedProcess:
    # without PYTHONSAFEPATH, which would leave the root off the child's sys.path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)


def test_transformers_and_our_kernels_import_at_the_root():
    code = ("import transformers, kernels, infergraft.kernels.dispatch as d\n"
            "transformers.LlamaConfig()\n"
            "print(kernels.__file__)\nprint(d.__file__)\n")
    out = run_at_root("-c", code)
    assert out.returncode == 0, out.stderr
    hf_kernels, dispatch = map(Path, out.stdout.split())
    assert "site-packages" in hf_kernels.parts  # Hugging Face's, not our folder
    assert dispatch.parent.name == "kernels"


def test_a_command_that_reads_a_model_runs_at_the_root(tmp_path):
    tiny_llama_config().save_pretrained(tmp_path)
    out = run_at_root("-m", "infergraft.core.cli", "plan", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["weight_bytes"] > 0


def test_the_top_level_folders_but_core_are_namespace_portions():
    # a folder with an __init__.py is a regular package, which Python takes for a
    # top-level import of its name ahead of any installed package; a portion it passes by
    # (core/ keeps its __init__.py: it is infergraft.core's face, `core.build`, ...)
    assert [f for f in ("kernels", "plugins", "policies", "tests")
            if (ROOT / f / "__init__.py").exists()] == []
