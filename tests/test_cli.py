"""The command line: make-checkpoint writes a checkpoint transformers and the engine both load; generate
streams text and its timings; errors are one line and a non-zero exit."""

import warnings

import pytest
import torch

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


def test_chat_runs_turns_until_an_empty_line(tiny, capsys, monkeypatch):
    lines = iter(["Hello!", "And again?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", str(tiny), "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.count("\n") >= 2


@pytest.mark.parametrize("arguments, message", [
    (["generate", "--model", "/nonexistent/model", "x"], "no config.json"),
    (["generate", "--max-new-tokens", "0", "x"], "max_new_tokens"),
])
def test_errors_are_one_line_and_exit_non_zero(tiny, arguments, message, capsys):
    if "--model" not in arguments:
        arguments = arguments[:1] + ["--model", str(tiny)] + arguments[1:]
    assert main(arguments) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("qwen-triton: error:") and message in err


def test_empty_prompt_and_missing_gpu(tiny, capsys):
    assert main(["generate", "--model", str(tiny), ""]) == 1
    assert "empty" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["generate", "--model", str(tiny), "--device", "cuda", "x"]) == 1
        assert "no CUDA GPU" in capsys.readouterr().err
