"""The README's code must run as written."""
import importlib.util
import re
from pathlib import Path

import pytest

from infergraft import core
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_starts_with_the_two_commands():
    text = README.read_text()
    first_two = _blocks("bash")[:2]
    assert len(first_two) == 2 and text.index("```bash") < text.index("```python")
    assert "infergraft generate" in first_two[0] and "pytest" in first_two[1]


def test_ten_line_plugin_example_registers_and_builds(tmp_path):
    snippet = next(b for b in _blocks("python") if "infergraft_register_cache_backends" in b)
    path = tmp_path / "my_cache.py"
    path.write_text(snippet)
    spec = importlib.util.spec_from_file_location("my_cache", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    hf = random_model(tiny_llama_config(), seed=1)
    engine = core.build(hf, plugins=[module], max_seq_len=32, max_batch_size=2)
    assert engine.plan.cache_backend == "my-cache"
    plain = core.build(hf, max_seq_len=32, max_batch_size=2)  # the contiguous cache it renames
    prompts = [random_prompt(5, 256, 0), random_prompt(9, 256, 1)]
    got = [c.token_ids for c in engine.generate(prompts, max_new_tokens=6)]
    assert got == [c.token_ids for c in plain.generate(prompts, max_new_tokens=6)]
    assert all(got)


@pytest.mark.slow
def test_the_python_api_blocks_run_on_the_demo_model(capsys):
    """The README's first two Python blocks, as written, one after the other."""
    api, asynchronous = _blocks("python")[:2]
    assert "core.build(\"smollm2-135m\")" in api and "AsyncEngine" in asynchronous
    namespace = {}
    exec(compile(api, "README: Python API", "exec"), namespace)
    assert "Paris" in namespace["done"][0].text
    seq = namespace["seq"]
    assert seq.finished and len(seq.logprobs) == len(seq.output_ids) > 0
    capsys.readouterr()
    exec(compile(asynchronous, "README: asynchronous", "exec"), namespace)
    assert "Paris" in capsys.readouterr().out
