"""The README's commands and Python snippets, executed as written: the quick start runs what it says it runs,
the usage commands work, the Python snippet runs, the server answers the Serve section's curl and openai calls.

Real weights cannot be downloaded here, so the repo id the README uses (`Qwen/Qwen3.5-0.8B`) and the directory it
names (`./Qwen3.5-0.8B`) hold the tiny preset's random checkpoint, in an offline Hugging Face cache made by the
test: the code paths are the ones a user with the real checkpoint takes."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qwen_triton.checkpoint import make_preset_checkpoint
from tests.test_hub import fake_hub_cache

README = Path(__file__).resolve().parent.parent / "README.md"
REPO_ID = "Qwen/Qwen3.5-0.8B"


def code_blocks(section: str, language: str) -> list[str]:
    """The ```language blocks of the README section (or subsection) whose heading is `section`, up to the next
    heading."""
    text = README.read_text()
    body = re.split(r"^###? ", text, flags=re.M)
    chosen = next(part for part in body if part.startswith(section + "\n"))
    return re.findall(rf"```{language}\n(.*?)```", chosen, flags=re.S)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A working directory with ./Qwen3.5-0.8B and prompt.txt, an offline hub cache holding the repo id, and the
    environment of a user's shell (qwen-triton on the PATH, a cache directory of its own)."""
    root = tmp_path_factory.mktemp("user")
    checkpoint = make_preset_checkpoint("tiny", root / "Qwen3.5-0.8B", seed=0)
    fake_hub_cache(root / "hub", REPO_ID, checkpoint)
    (root / "prompt.txt").write_text("A prompt from a file.\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(root / "hub"), XDG_CACHE_HOME=str(root / "cache"),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    return root, env


def run(command: str, root: Path, env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=root, env=env, capture_output=True,
                            text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
def test_the_quick_start_runs_what_it_says(workspace):
    """The quick start's command after the install (the venv and pip steps are what CI's own run does)."""
    root, env = workspace
    (block,) = code_blocks("Quick start", "bash")[:1]
    commands = [part.strip() for part in block.strip().split("&&") if part.strip().startswith("qwen-triton")]
    assert commands == ['qwen-triton generate --backend triton --max-new-tokens 16 "The capital of France is"']
    result = run(commands[0], root, env)
    assert "triton backend" in result.stderr and "tokens/s" in result.stderr
    if not torch.cuda.is_available():
        assert "the Triton kernels under Triton's interpreter" in result.stderr
        assert "random-weight tiny model" in result.stderr
    assert result.stdout.strip()


def test_the_usage_commands_run(workspace):
    root, env = workspace
    (block,) = code_blocks("Usage", "bash")
    for line in block.strip().splitlines():
        command = line.split("  #")[0].strip()  # the comment after a command
        result = run(command, root, env)
        if "--version" in command:
            assert result.stdout.startswith("qwen-triton ")
    piped = next(l for l in block.splitlines() if "| qwen-triton generate -" in l)
    run(piped.split("# or: ")[1], root, env)


def test_the_python_snippet_runs(workspace):
    root, env = workspace
    (snippet,) = code_blocks("Usage", "python")
    result = subprocess.run([sys.executable, "-c", snippet], cwd=root, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch.Size([" in result.stdout


def test_the_serve_example_answers(workspace, tmp_path):
    """The Serve section: the server started as written (on a free port instead of 8000), the curl command and the
    Python snippet answered, then SIGTERM and exit status 0."""
    root, env = workspace
    (commands,) = code_blocks("Serve", "bash")
    (snippet,) = code_blocks("Serve", "python")
    serve, curl = [line.split("  #")[0].strip() for line in commands.strip().splitlines()]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def on_port(text: str) -> str:
        assert "8000" in text
        return text.replace("8000", str(port))

    log = tmp_path / "serve.log"
    process = subprocess.Popen(["bash", "-c", "exec " + on_port(serve)], cwd=root, env=env, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=log.open("w"))
    try:
        deadline = time.monotonic() + 120
        while "serving" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        reply = json.loads(run(on_port(curl), root, env).stdout)
        assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] >= 1
        result = subprocess.run([sys.executable, "-c", on_port(snippet)], cwd=root, env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
