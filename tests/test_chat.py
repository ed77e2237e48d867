"""`qwen-triton chat` driven as a person drives it, through a pseudo-terminal: line editing and history
(readline), Ctrl-C mid-reply keeps the conversation, commands, /exit."""

import fcntl
import os
import select
import signal
import subprocess
import sys
import termios
import time
from types import SimpleNamespace

import pytest

from qwen_triton.chat import Chat, ThinkingSplitter
from qwen_triton.checkpoint import make_preset_checkpoint

pty = pytest.importorskip("pty")


def _own_terminal():
    """In the child: a session of its own whose controlling terminal is the pseudo-terminal on its stdin, so
    that Ctrl-C typed there becomes SIGINT, as in a real terminal."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    # started with SIGINT ignored and blocked, as a parent that ignores it leaves a child (a test worker once did):
    # the chat takes Ctrl-C back
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


class Terminal:
    """A command on the slave side of a pseudo-terminal; what it writes is collected from the master side."""

    def __init__(self, arguments, env):
        master, slave = pty.openpty()
        self.process = subprocess.Popen(arguments, stdin=slave, stdout=slave, stderr=slave, env=env,
                                        preexec_fn=_own_terminal)
        os.close(slave)
        self.master, self.output = master, b""

    def read_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([self.master], [], [], 0.05)
            if ready:
                try:
                    self.output += os.read(self.master, 65536)
                except OSError:  # the child closed the terminal
                    return

    def wait_for(self, text: str, seconds: float = 120, start: int = 0) -> int:
        """Wait until `text` appears after offset `start` of the output; returns the offset after it."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            index = self.output.find(text.encode(), start)
            if index >= 0:
                return index + len(text)
            self.read_for(0.1)
        raise AssertionError(f"{text!r} did not appear; the terminal shows:\n{self.output.decode(errors='replace')}")

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def close(self) -> int:
        try:
            return self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
            os.close(self.master)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_preset_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=5)


def test_chat_in_a_terminal(tiny, tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), TERM="xterm")
    # replies long enough to be interrupted at any CPU's speed
    terminal = Terminal([sys.executable, "-m", "qwen_triton.cli", "chat", "--model", str(tiny), "--device", "cpu",
                         "--backend", "reference", "--max-new-tokens", "3000"], env)
    try:
        at = terminal.wait_for("> ")
        terminal.type(b"/help\r")
        at = terminal.wait_for("/think", start=at)
        at = terminal.wait_for("> ", start=at)
        terminal.type(b"\r")  # an empty line is ignored: the prompt comes back, nothing is generated
        at = terminal.wait_for("> ", start=at)
        terminal.type(b"Hello there\r")
        terminal.read_for(1.5)
        terminal.type(b"\x03")  # Ctrl-C mid-reply
        at = terminal.wait_for("[reply stopped; the conversation is kept: 2 messages]", start=at)
        at = terminal.wait_for("> ", start=at)
        terminal.type(b"\x1b[A\r")  # the up arrow recalls the last line from the history
        at = terminal.wait_for("Hello there", start=at)
        terminal.read_for(1.5)
        terminal.type(b"\x03")
        at = terminal.wait_for("[reply stopped; the conversation is kept: 4 messages]", start=at)
        terminal.type(b"/clear\r")
        at = terminal.wait_for("(conversation cleared: 0 messages)", start=at)
        terminal.type(b"/nonsense\r")
        at = terminal.wait_for("unknown command /nonsense", start=at)
        terminal.type(b"/exit\r")
        assert terminal.close() == 0
    finally:
        if terminal.process.poll() is None:
            os.killpg(terminal.process.pid, signal.SIGKILL)
    history = (tmp_path / "cache" / "qwen-triton" / "chat-history").read_text()
    assert "Hello there" in history and "/exit" in history


class Recorder:
    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text

    def flush(self):
        pass


@pytest.mark.parametrize("pieces", [
    ["<think>", "\nweigh", " it", "</think>", "\n\nThe answer."],
    ["<thi", "nk>\nweigh it</th", "ink>\n\nThe answer."],  # tags split across pieces
])
def test_thinking_is_shown_apart_from_the_answer(pieces):
    out = Recorder()
    splitter = ThinkingSplitter(out, thinking=False, terminal=False)
    for piece in pieces:
        splitter.feed(piece)
    splitter.finish()
    assert out.text == "thinking: weigh it\nanswer: The answer.\n"


def test_a_reply_opened_in_thinking_mode_by_the_prompt():
    out = Recorder()
    splitter = ThinkingSplitter(out, thinking=True, terminal=True)
    for piece in ["hmm", "</think>", "\n\nYes."]:
        splitter.feed(piece)
    splitter.finish()
    assert out.text == "\x1b[2mthinking: hmm\x1b[0m\nYes.\n"


def test_ctrl_c_before_the_reply_begins_keeps_the_chat(capsys):
    # Ctrl-C while the prompt is rendered or encoded (a long conversation): the reply is not begun, the conversation
    # is kept as it was, and the chat goes on (the interrupt does not reach the command, which would end it)
    class Tokenizer:
        def apply_chat_template(self, messages, **keywords):
            raise KeyboardInterrupt

    llm = SimpleNamespace(tokenizer=Tokenizer(), max_length=64)
    chat = Chat(llm, SimpleNamespace(system="be brief", thinking=None, max_new_tokens=8))
    chat.reply("Hello")
    assert chat.messages == [{"role": "system", "content": "be brief"}]
    assert "[stopped before the reply began; the conversation is kept: 1 messages]" in capsys.readouterr().err
