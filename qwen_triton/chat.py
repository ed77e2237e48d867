"""`qwen-triton chat`: a multi-turn conversation in the terminal.

Line editing and history through readline (kept in ~/.cache/qwen-triton/chat-history); commands start with
a slash (`/help` lists them); an empty line is ignored; Ctrl-C stops the reply being written and keeps the
conversation, Ctrl-D or /exit ends it. After each reply a line on stderr gives its tokens, the time to its
first token and the decode rate, and says when the reply was cut at a limit. With thinking on, what the model
writes between <think> and </think> is shown apart from the answer (dimmed on a terminal).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from .cli import budget_note, format_statistics, sampling_keywords

HELP = """commands:
  /exit, /quit      end the chat (Ctrl-D too)
  /clear            forget the conversation (the system message stays)
  /system TEXT      set the system message and start over (/system alone removes it)
  /think [on|off]   switch Qwen3.5's thinking mode (alone: toggle)
  /help             this list
  Ctrl-C            stop the reply being written (the conversation is kept)
  a message that starts with // is sent with a single /"""

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
DIM, RESET = "\x1b[2m", "\x1b[0m"


class ThinkingSplitter:
    """Splits a streamed reply into its thinking part (between <think> and </think>) and its answer, and
    writes each as it comes: the thinking dimmed on a terminal, under a "thinking:" label otherwise."""

    def __init__(self, out, thinking: bool, terminal: bool):
        self.out, self.thinking, self.terminal = out, thinking, terminal
        self.pending = ""  # text that may be the start of a tag
        self.after_tag = thinking  # the newlines that follow a tag are the tag's, not the text's
        if thinking:
            self._enter_thinking()

    def _enter_thinking(self):
        self.out.write(DIM + "thinking: " if self.terminal else "thinking: ")

    def _leave_thinking(self):
        self.out.write(RESET + "\n" if self.terminal else "\nanswer: ")

    def feed(self, piece: str) -> None:
        text = self.pending + piece
        self.pending = ""
        while text:
            if self.after_tag:
                text = text.lstrip("\n")
                if not text:
                    break
                self.after_tag = False
            tag = THINK_CLOSE if self.thinking else THINK_OPEN
            index = text.find(tag)
            if index >= 0:
                self._write(text[:index])
                text = text[index + len(tag):]
                if self.thinking:
                    self._leave_thinking()
                else:
                    self._enter_thinking()
                self.thinking = not self.thinking
                self.after_tag = True
                continue
            keep = next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)
            self._write(text[:len(text) - keep])
            self.pending = text[len(text) - keep:]
            break
        self.out.flush()

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)

    def finish(self) -> None:
        self._write(self.pending)
        self.pending = ""
        if self.thinking and self.terminal:
            self.out.write(RESET)
        self.out.write("\n")
        self.out.flush()


def _take_ctrl_c():
    """Make Ctrl-C (SIGINT) raise KeyboardInterrupt in this process, whatever it inherited: a process started with
    SIGINT ignored (a background job of a non-interactive shell, a parent that ignores it) or blocked passes both on
    to its children, and the chat's Ctrl-C would then do nothing. Returns the handler to restore (None off the main
    thread, where signals cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if hasattr(signal, "pthread_sigmask"):  # POSIX
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    return signal.signal(signal.SIGINT, signal.default_int_handler)


class Chat:
    def __init__(self, llm, args, history_file: Path | None = None):
        self.llm, self.args = llm, args
        self.system = args.system
        self.thinking = args.thinking  # None: the template's default
        self.messages: list[dict] = []
        self.history_file = history_file
        self.readline = None
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    # ---- line input ------------------------------------------------------------------------------
    def _start_readline(self) -> None:
        if not sys.stdin.isatty():
            return
        try:
            import readline
        except ImportError:  # no line editing on this platform; input() still works
            return
        self.readline = readline
        readline.set_history_length(1000)
        if self.history_file is not None and self.history_file.exists():
            try:
                readline.read_history_file(self.history_file)
            except OSError:
                pass

    def _save_history(self) -> None:
        if self.readline is None or self.history_file is None:
            return
        try:
            self.history_file.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(self.history_file)
        except OSError:
            pass

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        self._start_readline()
        print("chat: type a message; /help lists the commands; Ctrl-D or /exit ends the chat", file=sys.stderr)
        previous = _take_ctrl_c()
        try:
            while True:
                try:
                    line = input("> ")
                except EOFError:
                    print(file=sys.stderr)
                    return
                except KeyboardInterrupt:
                    print("\n(Ctrl-D or /exit ends the chat)", file=sys.stderr)
                    continue
                if not line.strip():
                    continue
                if line.startswith("/") and not line.startswith("//"):
                    if self.command(line.strip()):
                        return
                    continue
                self.reply(line[1:] if line.startswith("//") else line)
        finally:
            self._save_history()
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def command(self, line: str) -> bool:
        """Run a slash command; True when the chat should end."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit"):
            return True
        if name == "/help":
            print(HELP, file=sys.stderr)
        elif name == "/clear":
            self.clear()
            print(f"(conversation cleared: {len(self.messages)} messages)", file=sys.stderr)
        elif name == "/system":
            self.system = rest or None
            self.clear()
            print(f"(system message {'set' if rest else 'removed'}; conversation cleared)", file=sys.stderr)
        elif name == "/think":
            if rest not in ("", "on", "off"):
                print("(/think takes on or off)", file=sys.stderr)
                return False
            self.thinking = (not self.thinking_on()) if not rest else rest == "on"
            print(f"(thinking {'on' if self.thinking else 'off'})", file=sys.stderr)
        else:
            print(f"(unknown command {name}; /help lists them)", file=sys.stderr)
        return False

    def thinking_on(self) -> bool:
        """Whether the next reply opens in thinking mode, as the template renders it."""
        return self._prompt([{"role": "user", "content": "x"}]).endswith(THINK_OPEN + "\n") or bool(self.thinking)

    def _prompt(self, messages: list[dict]) -> str:
        variables = {} if self.thinking is None else {"enable_thinking": self.thinking}
        return self.llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **variables)

    def reply(self, text: str) -> None:
        llm, args = self.llm, self.args
        messages = self.messages + [{"role": "user", "content": text}]
        try:  # a long conversation takes a while to render and encode: Ctrl-C there keeps the chat going too
            prompt = self._prompt(messages)
            prompt_tokens = len(llm.tokenizer.encode(prompt))
        except KeyboardInterrupt:
            print(f"[stopped before the reply began; the conversation is kept: {len(self.messages)} messages]",
                  file=sys.stderr)
            return
        cut = budget_note(prompt_tokens, args.max_new_tokens, llm.max_length)
        if cut and prompt_tokens >= llm.max_length:
            print(f"(the conversation is too long: {cut}; /clear starts over)", file=sys.stderr)
            return
        # thinking opened by the prompt itself (Qwen3.5's template with thinking on) or by the model's <think>
        splitter = ThinkingSplitter(sys.stdout, thinking=prompt.endswith(THINK_OPEN + "\n"),
                                    terminal=sys.stdout.isatty())
        pieces = []
        stream = llm.stream(prompt, **sampling_keywords(args))
        try:
            for piece in stream:
                pieces.append(piece)
                splitter.feed(piece)
        except KeyboardInterrupt:
            stream.close()
            splitter.finish()
            self.messages = messages + [{"role": "assistant", "content": "".join(pieces)}]
            print(f"[reply stopped; the conversation is kept: {len(self.messages)} messages]", file=sys.stderr)
            return
        splitter.finish()
        result = llm.last_generation
        self.messages = messages + [{"role": "assistant", "content": "".join(pieces)}]
        statistics = format_statistics(result, args.max_new_tokens)
        context = len(result.prompt_token_ids) + len(result.token_ids)
        print(f"{statistics[:-1]}; context {context} of {llm.max_length} tokens]", file=sys.stderr)
        if cut and result.finish_reason == "length":
            print(f"(note: {cut})", file=sys.stderr)
