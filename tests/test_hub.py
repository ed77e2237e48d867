"""--model and LLM(...) take a Hugging Face repo id, resolved from a local Hugging Face cache (offline here),
as transformers and vLLM resolve it."""

import shutil

import pytest
import torch

from qwen_triton import LLM
from qwen_triton.checkpoint import make_preset_checkpoint
from qwen_triton.cli import main
from qwen_triton.hub import ModelNotFound, looks_like_repo_id, resolve_model


def fake_hub_cache(cache, repo_id: str, checkpoint, commit: str = "0123456789abcdef0123456789abcdef01234567"):
    """A Hugging Face hub cache holding `checkpoint`'s files as the snapshot of repo_id's main branch, in the
    layout huggingface_hub writes (models--OWNER--NAME/{refs/main, snapshots/COMMIT/...})."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in checkpoint.iterdir():
        shutil.copy(file, snapshot / file.name)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_preset_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, tiny):
    cache = tmp_path / "hub"
    snapshot = fake_hub_cache(cache, "Qwen/Qwen3.5-Tiny", tiny)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def test_repo_id_resolves_to_the_cached_snapshot(offline_cache):
    assert resolve_model("Qwen/Qwen3.5-Tiny") == offline_cache


def test_a_directory_wins_over_a_repo_id(tmp_path, tiny, monkeypatch):
    monkeypatch.chdir(tiny.parent)
    assert resolve_model(tiny.name) == tiny  # a relative directory is a directory, not a repo id
    assert looks_like_repo_id("Qwen/Qwen3.5-0.8B") and not looks_like_repo_id("./model")
    assert not looks_like_repo_id("/abs/path") and not looks_like_repo_id("a/b/c")


def test_missing_repo_in_an_offline_cache_is_one_clear_error(offline_cache):
    with pytest.raises(ModelNotFound, match="Qwen/Other: not a directory, not in the local Hugging Face cache, "
                                            "with HF_HUB_OFFLINE set"):
        resolve_model("Qwen/Other")


def test_llm_and_the_cli_take_a_repo_id(offline_cache, tiny, capsys):
    by_id = LLM("Qwen/Qwen3.5-Tiny", backend="reference", dtype=torch.float32)
    by_path = LLM(tiny, backend="reference", dtype=torch.float32)
    assert by_id.path == offline_cache
    expected = by_path.generate("Hello", max_new_tokens=4).token_ids
    assert by_id.generate("Hello", max_new_tokens=4).token_ids == expected
    assert main(["generate", "--model", "Qwen/Qwen3.5-Tiny", "--max-new-tokens", "4", "Hello"]) == 0
    captured = capsys.readouterr()
    assert f"loading {offline_cache}" in captured.err
    assert captured.out.rstrip("\n") == by_path.tokenizer.decode(expected, skip_special_tokens=True)
