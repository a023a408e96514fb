"""``infergraft generate``: the metrics line after a streamed answer, empty prompts
refused before the model loads, and Ctrl-C exiting 130 without a traceback (here and in
every other subcommand)."""
import re

import pytest
import torch

from infergraft.core import cli
from cli_support import Cli, tiny_chat_model

PROMPT = "hello there"
METRICS = re.compile(r"\[(\d+) tokens, finish=(\w+), TTFT [\d.]+ ms, TPOT [\d.]+ ms, "
                     r"[\d.]+ tok/s\]$", re.M)
# a subcommand -> the shortest argv that parses (a new subcommand must be added here)
ARGV = {"generate": ["generate", PROMPT], "chat": ["chat"], "plugins": ["plugins"],
        "plan": ["plan"], "bench": ["bench"], "serve": ["serve"],
        "quantize": ["quantize", "smollm2-135m", "--out", "unused"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))


@pytest.fixture
def one_thread():
    """One torch thread: on a busy 2-core machine two threads spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def generate(capsys, model_dir, *extra):
    argv = ["generate", PROMPT, "--model", model_dir, "--max-seq-len", "128", *extra]
    assert cli.main(argv) == 0
    return capsys.readouterr()


def test_stream_verbose_prints_the_metrics_line_and_the_same_text(capsys, model_dir,
                                                                  one_thread):
    plain = generate(capsys, model_dir, "--max-new-tokens", "12", "-v")
    streamed = generate(capsys, model_dir, "--max-new-tokens", "12", "--stream", "-v")
    assert streamed.out == plain.out and plain.out.strip()
    assert METRICS.search(streamed.err).groups() == ("12", "length") == \
        METRICS.search(plain.err).groups()


def test_stream_with_a_stop_string_prints_what_generate_prints(capsys, model_dir, one_thread):
    text = generate(capsys, model_dir, "--max-new-tokens", "12").out.strip()
    stop = text.split()[2]  # a word of the answer: it ends it early
    plain = generate(capsys, model_dir, "--max-new-tokens", "12", "--stop", stop, "-v")
    streamed = generate(capsys, model_dir, "--max-new-tokens", "12", "--stop", stop,
                        "--stream", "-v")
    assert streamed.out == plain.out and len(plain.out.strip()) < len(text)
    assert METRICS.search(streamed.err).group(2) == "stop"


@pytest.mark.parametrize("prompt", ["", "  \n\t"])
def test_an_empty_prompt_is_refused_before_the_model_loads(capsys, monkeypatch, prompt):
    def no_build(*a, **k):
        raise AssertionError("the model was loaded for an empty prompt")

    monkeypatch.setattr(cli, "build", no_build)
    assert cli.main(["generate", prompt]) == 2
    err = capsys.readouterr().err
    assert "prompt is empty" in err and "whitespace" in err


def test_ctrl_c_in_any_subcommand_exits_130_without_a_traceback(capsys, monkeypatch):
    real = cli.make_parser
    assert set(ARGV) == set(real()._subparsers._group_actions[0].choices)

    def interrupted(args):
        raise KeyboardInterrupt

    def parser_whose_commands_are_interrupted():
        parser = real()
        parse = parser.parse_args

        def parse_args(argv):
            args = parse(argv)
            args.func = interrupted
            return args

        parser.parse_args = parse_args
        return parser

    monkeypatch.setattr(cli, "make_parser", parser_whose_commands_are_interrupted)
    for argv in ARGV.values():
        assert cli.main(argv) == 130, argv
        assert capsys.readouterr().err == "infergraft: interrupted\n"


def test_ctrl_c_turned_into_an_extensions_error_still_exits_130(capsys, monkeypatch):
    """safetensors, interrupted while it reads a tensor, raises a ValueError of its own in
    place of the KeyboardInterrupt: after a real SIGINT that is an interrupt too; the same
    error without one is raised as it is."""
    import signal

    def reading_a_tensor(args):
        if args.interrupt:
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                pass
        raise ValueError("could not determine the shape of object type 'UntypedStorage'")

    real = cli.make_parser

    def parser(interrupt):
        def make():
            p = real()
            parse = p.parse_args

            def parse_args(argv):
                args = parse(argv)
                args.func, args.interrupt = reading_a_tensor, interrupt
                return args

            p.parse_args = parse_args
            return p
        return make

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(cli, "make_parser", parser(True))
    assert cli.main(["plugins"]) == 130
    assert capsys.readouterr().err == "infergraft: interrupted\n"
    monkeypatch.setattr(cli, "make_parser", parser(False))
    with pytest.raises(ValueError, match="UntypedStorage"):
        cli.main(["plugins"])
    assert signal.getsignal(signal.SIGINT) is before  # put back


@pytest.mark.parametrize("stream", [True, False])
def test_ctrl_c_while_generating_exits_130_quietly(model_dir, stream):
    run = Cli("generate", PROMPT, "--model", model_dir, "--max-seq-len", "4096",
              "--max-new-tokens", "4000", *(["--stream"] if stream else []))
    if stream:  # interrupted as the answer comes
        run.wait_for(lambda out, err: len(out) > 0)
    else:  # interrupted once the weights load: from then on the command runs in main()
        run.wait_for(lambda out, err: "loading weights" in err)
    run.interrupt()
    rc, out, err = run.finish()
    assert rc == 130 and "Traceback" not in err, err
    assert err.rstrip().endswith("infergraft: interrupted")
    assert out.endswith("\n") if stream else out == ""  # a partial answer ends its line
