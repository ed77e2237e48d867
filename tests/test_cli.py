"""The command line: make-checkpoint writes a checkpoint transformers and the engine both load; generate
streams text and its timings; errors are one line and a non-zero exit."""

import io
import shutil
import warnings

import pytest
import torch

import qwen_triton
from qwen_triton import LLM
from qwen_triton.cli import main
from tests.support import relative_error, transformers_logits, transformers_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(directory), "--seed", "1"]) == 0
    return directory


def test_tiny_checkpoint_is_complete_and_matches_transformers(tiny):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny / name).exists(), name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle = transformers_model(tiny)
    llm = LLM(tiny, backend="reference", dtype=torch.float32, max_length=64)
    token_ids = llm.tokenizer.encode("Hello, 世界! 🎉 Qwen3.5")
    assert relative_error(llm.score(token_ids), transformers_logits(oracle, token_ids)) <= 1e-4


def test_generate_streams_text_and_timings(tiny, capsys):
    assert main(["generate", "--model", str(tiny), "--max-new-tokens", "5", "--device", "cpu", "Hi there"]) == 0
    captured = capsys.readouterr()
    assert "tokens/s" in captured.err and "time to first token" in captured.err
    llm = LLM(tiny, backend="reference", dtype=torch.float32, max_length=4096)
    expected = llm.generate("Hi there", max_new_tokens=5).text
    assert captured.out.rstrip("\n") == expected


def test_chat_ignores_empty_lines_and_ends_at_exit(tiny, capsys, monkeypatch):
    lines = iter(["Hello!", "", "/think off", "And again?", "/exit", "never sent"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", str(tiny), "--max-new-tokens", "3", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("time to first token") == 2  # two replies, each with its statistics
    assert "thinking off" in captured.err
    assert next(lines) == "never sent"


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if the weights start loading: bad arguments must be refused before."""
    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded before the arguments were checked")
    monkeypatch.setattr("qwen_triton.engine.llm.load_weights", refuse)


@pytest.mark.parametrize("arguments, message", [
    (["--max-new-tokens", "0", "x"], "--max-new-tokens must be >= 1"),
    (["--max-length", "1", "x"], "--max-length must be >= 2"),
    (["--temperature", "-0.5", "x"], "--temperature must be >= 0"),
    (["--temperature", "nan", "x"], "--temperature must be >= 0"),
    (["--top-k", "-1", "x"], "--top-k must be >= 0"),
    (["--top-p", "0", "x"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5", "x"], "--top-p must be in (0, 1]"),
    (["--seed", "-3", "x"], "--seed must be >= 0"),
    (["--stop", "", "x"], "--stop must not be empty"),
    (["--min-p", "1.5", "x"], "--min-p must be in [0, 1]"),
    (["--presence-penalty", "3", "x"], "--presence-penalty must be in [-2, 2]"),
    (["--frequency-penalty", "-2.5", "x"], "--frequency-penalty must be in [-2, 2]"),
    (["--repetition-penalty", "0", "x"], "--repetition-penalty must be > 0"),
    (["--max-length", "3", "a prompt of more than three tokens"], "no room to reply within --max-length 3"),
    ([], "no prompt"),
    ([""], "the prompt is empty"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file /nonexistent/prompt.txt: no such file"),
    (["--prompt-file", "p.txt", "x"], "not both"),
    (["--thinking", "x"], "--thinking / --no-thinking need --chat-template"),
])
def test_bad_arguments_are_one_line_naming_the_flag_before_loading(tiny, arguments, message, capsys, no_loading):
    assert main(["generate", "--model", str(tiny), *arguments]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qwen-triton: error:") and message in err[0], err


def test_argparse_errors_are_one_line_with_exit_status_2(capsys):
    for arguments in (["generate", "--max-new-tokens", "many", "x"], ["generate", "--no-such-flag", "x"],
                      ["bench", "--variants", "nope"], ["profile", "--context", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            status = main(arguments)
            raise SystemExit(status)
        assert exit_info.value.code == 2, arguments
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error:" in err[0], (arguments, err)


@pytest.mark.parametrize("model, message", [
    ("/nonexistent/model", "--model /nonexistent/model: no such directory"),
    ("config.json", "is a file: a model is a checkpoint directory or a Hugging Face repo id; did you mean its directory"),
    ("Qwen/No-Such-Model", "not in the local Hugging Face cache, with HF_HUB_OFFLINE set"),
])
def test_bad_models_are_one_line(tiny, model, message, capsys, monkeypatch, tmp_path, no_loading):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    model = str(tiny / "config.json") if model == "config.json" else model
    assert main(["generate", "--model", model, "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_prompt_from_a_file_and_from_standard_input(tiny, capsys, monkeypatch, tmp_path):
    expected = LLM(tiny, backend="reference", dtype=torch.float32).generate("From a file", max_new_tokens=4).text
    (tmp_path / "prompt.txt").write_text("From a file\n")
    assert main(["generate", "--model", str(tiny), "--max-new-tokens", "4", "--prompt-file",
                 str(tmp_path / "prompt.txt")]) == 0
    assert capsys.readouterr().out.rstrip("\n") == expected
    monkeypatch.setattr("sys.stdin", io.StringIO("From a file\n"))
    assert main(["generate", "--model", str(tiny), "--max-new-tokens", "4", "-"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == expected


def test_penalties_reach_the_engine(tiny, capsys):
    llm = LLM(tiny, backend="reference", dtype=torch.float32)
    expected = llm.generate("Hi there", max_new_tokens=6, repetition_penalty=1.3, presence_penalty=0.5).text
    assert expected != llm.generate("Hi there", max_new_tokens=6).text  # the penalties change this reply
    assert main(["generate", "--model", str(tiny), "--max-new-tokens", "6", "--repetition-penalty", "1.3",
                 "--presence-penalty", "0.5", "Hi there"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == expected


def test_max_length_cutting_max_new_tokens_is_warned_and_reported(tiny, capsys):
    assert main(["generate", "--model", str(tiny), "--max-length", "6", "--max-new-tokens", "100", "Hi there"]) == 0
    err = capsys.readouterr().err
    assert "warning: --max-length 6 leaves room for 4 of the --max-new-tokens 100" in err
    assert "[4 tokens, finish: length" in err and "cut at --max-length" in err


def test_a_missing_tokenizer_json_is_noted(tiny, capsys, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny, copy)
    (copy / "tokenizer.json").unlink()
    assert main(["generate", "--model", str(copy), "--max-new-tokens", "2", "Hi"]) == 0
    assert "has no tokenizer.json: using the bundled Qwen3.5 tokenizer" in capsys.readouterr().err


def test_version_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"qwen-triton {qwen_triton.__version__} (torch ")
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 4096)", "(default: 64)", "0 = greedy (default: 0.0)", "1 = off (default: 1.0)"):
        assert default in help_text, default


def test_errors_of_the_run_are_one_line_with_exit_status_1(tiny, capsys):
    if not torch.cuda.is_available():
        assert main(["generate", "--model", str(tiny), "--device", "cuda", "x"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no CUDA GPU" in err[0]
    broken = tiny.parent / "broken"
    shutil.copytree(tiny, broken, dirs_exist_ok=True)
    (broken / "config.json").write_text("{not json")
    assert main(["generate", "--model", str(broken), "x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not valid JSON" in err[0]


def test_no_warm_up_reaches_the_llm_and_bench_takes_it_with_workloads_only(tiny, capsys, monkeypatch):
    """generate and chat pass --no-warm-up on as LLM(warm_up=False) (without it: None, the device's default)."""
    from qwen_triton.engine import llm as llm_module

    given = []
    original = llm_module.LLM.__init__

    def record(self, *args, warm_up=None, **kwargs):
        given.append(warm_up)
        original(self, *args, warm_up=warm_up, **kwargs)

    monkeypatch.setattr(llm_module.LLM, "__init__", record)
    for flags in ([], ["--no-warm-up"]):
        assert main(["generate", "--model", str(tiny), "--max-new-tokens", "2", *flags, "Hi"]) == 0
    assert given == [None, False]
    capsys.readouterr()
    assert main(["bench", "--device", "cpu", "--no-warm-up"]) == 2
    assert "--no-warm-up is for --workloads" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_tune_refuses_without_a_gpu_and_checks_its_sizes(capsys):
    assert main(["tune", "--max-batch", "0"]) == 2
    assert "--max-batch and --max-length must be >= 1" in capsys.readouterr().err
    assert main(["tune"]) == 1
    assert "tune needs a CUDA GPU" in capsys.readouterr().err


def test_the_default_model_is_made_once_even_when_another_command_makes_it_meanwhile(tmp_path, monkeypatch):
    """Two commands started at once on a fresh machine both make the random checkpoint, each under a name of its
    own; the one that renames second keeps the first's and drops its copy."""
    import qwen_triton.checkpoint as checkpoint
    from qwen_triton import cli

    monkeypatch.setattr(cli, "DEFAULT_CACHE", tmp_path)
    made = []

    def make_while_another_finishes(preset, directory, seed, progress=None):
        made.append(directory)
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")
        other = tmp_path / "checkpoints" / f"{preset}-seed0"  # the other command, done first
        other.mkdir(parents=True)
        (other / "config.json").write_text('{"other": true}')

    monkeypatch.setattr(checkpoint, "make_preset_checkpoint", make_while_another_finishes)
    directory = cli.default_model("cpu")
    assert directory == tmp_path / "checkpoints" / "tiny-seed0"
    assert (directory / "config.json").read_text() == '{"other": true}'
    assert len(made) == 1 and not made[0].exists()  # this command's copy, dropped
    assert cli.default_model("cpu") == directory and len(made) == 1  # made once: reused after
