"""docs/from-deepspeed.md's code as written: its config is the seed example, the two
scripts differ in the lines its diff shows, our script, its keyword form and the
core.build block run under ``torchrun --nproc-per-node 2`` on a tiny LLaMA, the commands
parse, and the offload block builds."""
import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from infergraft import core
from infergraft.core.cli import make_parser
from infergraft.core.testing.models import random_model, tiny_llama_config

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "from-deepspeed.md"
MODEL = "path/to/llama"  # the page's model directory


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE.read_text(), flags=re.S)


def _python(marker: str) -> str:
    found = [b for b in _blocks("python") if marker in b]
    assert len(found) == 1, f"one python block holding {marker!r}, found {len(found)}"
    return found[0]


THEIRS = _python("deepspeed.init_inference")
OURS = _python("from infergraft.core import init_inference")
KEYWORDS = _python("tensor_parallel={\"tp_size\": 2}")
BUILD = _python("core.build(\"path/to/llama\", config=")
OFFLOAD = _python("offload-weights")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny LLaMA directory (safetensors, float32) with a word-level tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("llama")
    hf = random_model(tiny_llama_config(), seed=0, scale=25.0)
    hf.save_pretrained(path)
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "Hello": 4, "What": 5, "is": 6}
    words.update({f"w{i}": i for i in range(7, 256)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>", unk_token="<unk>").save_pretrained(path)
    return path


def test_the_config_is_the_seed_example():
    (config,) = _blocks("json")
    assert json.loads(config) == json.loads((ROOT / "docs/examples/ds_config.json").read_text())


def test_the_scripts_differ_in_the_lines_the_diff_shows():
    theirs, ours = set(THEIRS.splitlines()), set(OURS.splitlines())
    (diff,) = _blocks("diff")

    def matches(shown, lines):  # "(...)" in the diff stands for the call's arguments
        pattern = re.escape(shown).replace(re.escape("(...)"), r"\(.*\)")
        return sorted(line for line in lines if re.fullmatch(pattern, line))

    def covers(shown_lines, lines):  # each shown line is one line, and all of them
        hits = [matches(shown, lines) for shown in shown_lines]
        assert all(len(h) == 1 for h in hits), hits
        assert sorted(h[0] for h in hits) == sorted(lines)

    covers([line[1:] for line in diff.splitlines() if line.startswith("-")], theirs - ours)
    covers([line[1:] for line in diff.splitlines() if line.startswith("+")], ours - theirs)


RANK_SCRIPT = '''
import contextlib, io, json, os, sys
blocks, out = json.loads(sys.argv[1]), sys.argv[2]
printed, namespace = [], {}
for name in ("ours", "build", "keywords"):
    if name == "keywords":  # the page's keyword form starts from the HF model again
        exec("model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float16)",
             namespace)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(compile(blocks[name], name, "exec"), namespace)
    printed.append(buffer.getvalue())
if os.environ["RANK"] == "0":
    plans = {k: namespace[k].plan for k in ("engine", "model")}
    with open(out, "w") as f:
        json.dump({"printed": printed, "plans": {k: [p.dtype, p.kv_dtype, p.planner, p.policy,
                   p.parallel.tensor_parallel] for k, p in plans.items()}}, f)
'''


def test_our_script_and_the_build_block_run_under_torchrun(model_dir, tmp_path):
    (tmp_path / "ds_config.json").write_text(_blocks("json")[0])
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    blocks = {k: b.replace(MODEL, str(model_dir))
              for k, b in (("ours", OURS), ("build", BUILD), ("keywords", KEYWORDS))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "rank.py", json.dumps(blocks), str(tmp_path / "rank0.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((tmp_path / "rank0.json").read_text())
    # the config's plan, and the keyword form's (no injection_policy, no K/V quantiser)
    assert got["plans"]["engine"] == ["float16", "int8", "tp", "llama", 2]
    assert got["plans"]["model"] == ["float16", "float16", "tp", "llama", 2]
    # the HF-style rows (prompt + new tokens, under tensor parallel, int8 K/V) are what the
    # plain engine gives each prompt alone; parity with HF itself: test_config_torchrun.py
    texts = ast.literal_eval(got["printed"][1])
    assert len(texts) == 2 and all(texts)
    rows = [f"{prompt} {text}" for prompt, text in zip(("Hello", "What is"), texts)]
    assert got["printed"][0] == f"{rows}\n"


def test_the_commands_parse():
    commands = [shlex.split(line) for b in _blocks("bash") for line in b.splitlines()
                if "infergraft.core.cli" in line]
    assert [c[:4] for c in commands] == [["torchrun", "--nproc-per-node", "2", "-m"]] * 2
    for command in commands:
        args = make_parser().parse_args(command[5:])
        assert (args.model, args.config) == (MODEL, "ds_config.json")
    assert [c[5] for c in commands] == ["generate", "serve"]


def test_the_offload_block_builds(model_dir):
    namespace = {}
    exec(compile(OFFLOAD.replace(MODEL, str(model_dir)), "offload", "exec"), namespace)
    engine = namespace["engine"]
    assert engine.plan.planner == "offload-weights"
    assert len(engine.generate("Hello", max_new_tokens=3)[0].token_ids) >= 1


def test_a_zero_offload_config_names_offload_weights():
    from infergraft.core.config import resolve_config
    from infergraft.core.errors import ConfigWarning

    with pytest.warns(ConfigWarning, match="offload-weights"):
        resolve_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})


def test_init_inference_takes_the_page_s_injection_policy_dict():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from infergraft.core.errors import ConfigWarning

    hf = random_model(tiny_llama_config(), seed=1)
    with pytest.warns(ConfigWarning, match="not needed"):
        engine = core.init_inference(hf, injection_policy={
            LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")}, max_out_tokens=64)
    assert engine.plan.policy == "llama" and engine.plan.max_seq_len == 64
