"""Where a model comes from: a checkpoint directory, or a Hugging Face repo id such as `Qwen/Qwen3.5-0.8B`.

A repo id is resolved as transformers and vLLM resolve it, through `huggingface_hub`: the files the engine
reads (config, safetensors weights and their index, tokenizer, chat template) from the local Hugging Face
cache, downloaded into it first where the network allows. `HF_HUB_OFFLINE=1` uses the cache alone;
`HF_HUB_CACHE` / `HF_HOME` choose the cache as they do for those libraries.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# what the engine reads from a checkpoint; the rest of a repo (vision processor files, READMEs) is not fetched
CHECKPOINT_FILES = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
]
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelNotFound(FileNotFoundError):
    """A model that is neither a checkpoint directory nor a Hugging Face repo id that can be had."""


def looks_like_repo_id(name: str) -> bool:
    """`owner/name`, the form of a Hugging Face repo id (a path that does not exist may still look like one)."""
    return bool(REPO_ID.match(name)) and not name.startswith(".")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model(model: str | os.PathLike, revision: str | None = None) -> Path:
    """The checkpoint directory of `model`: the directory itself, or the cached snapshot of a repo id.

    Raises ModelNotFound with a one-line reason: a file given instead of a directory, a path that does
    not exist, a repo id missing from an offline cache or not reachable.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path.absolute()
    if path.exists():
        hint = f"; did you mean its directory {path.parent}?" if path.name == "config.json" else ""
        raise ModelNotFound(f"{path} is a file: a model is a checkpoint directory or a Hugging Face repo id{hint}")
    name = os.fspath(model)
    if not looks_like_repo_id(name):
        raise ModelNotFound(f"{name}: no such directory (a model is a checkpoint directory or a repo id "
                            "such as Qwen/Qwen3.5-0.8B)")
    return _snapshot(name, revision)


def _snapshot(repo_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise ModelNotFound(f"{repo_id}: no such directory, and huggingface_hub is not installed to resolve it "
                            "as a repo id (pip install huggingface_hub)") from None
    try:
        # read at each call (not at import, as huggingface_hub's own constants are), so a caller's env counts
        directory = snapshot_download(repo_id, revision=revision, allow_patterns=CHECKPOINT_FILES,
                                      local_files_only=offline(), cache_dir=os.environ.get("HF_HUB_CACHE"))
    except LocalEntryNotFoundError:
        where = "with HF_HUB_OFFLINE set" if offline() else "and the Hugging Face Hub could not be reached"
        raise ModelNotFound(f"{repo_id}: not a directory, not in the local Hugging Face cache, {where}") from None
    except HfHubHTTPError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelNotFound(f"{repo_id}: not a directory, and the Hugging Face Hub refused it: {first_line}") from None
    except (OSError, ValueError) as error:
        raise ModelNotFound(f"{repo_id}: could not be resolved on the Hugging Face Hub: {error}") from None
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ModelNotFound(f"{repo_id}: the snapshot at {directory} has no config.json")
    return directory
