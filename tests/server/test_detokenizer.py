"""The incremental detokenizer: whatever the ids, the pieces it releases concatenate to the whole text cut before
its first stop string; an incomplete character or a possible start of a stop string is held back until
decided."""

import pytest

from qwen_triton.server.detokenizer import IncrementalDetokenizer
from tests.server.conftest import checkpoint_tokenizer

TEXT = "Hello, 世界! 🎉 naïve café — the end."


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return checkpoint_tokenizer(checkpoint)


def byte_ids(tokenizer, text):
    """Ids of single bytes (the byte-level vocabulary has one for each), so multi-byte characters arrive split."""
    by_bytes = {}
    for token_id in range(tokenizer.vocab_size):
        piece = tokenizer.token_bytes(token_id)
        if len(piece) == 1:
            by_bytes.setdefault(piece, token_id)
        if len(by_bytes) == 256:
            break
    return [by_bytes[bytes([b])] for b in text.encode("utf-8")]


def run(tokenizer, ids, stop=()):
    detokenizer = IncrementalDetokenizer(tokenizer, stop)
    pieces = [detokenizer.feed(token_id) for token_id in ids if not detokenizer.stopped]
    pieces.append(detokenizer.finish())
    return pieces, detokenizer


def test_split_characters_are_held_back_until_complete(tokenizer):
    ids = byte_ids(tokenizer, TEXT)
    pieces, _ = run(tokenizer, ids)
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces  # the first bytes of a character release nothing


@pytest.mark.parametrize("stop, expected", [
    (["世界"], "Hello, "),
    (["! 🎉"], "Hello, 世界"),
    (["café", "naïve"], "Hello, 世界! 🎉 "),  # the earliest stop string in the text wins
    (["end.", "xyz"], "Hello, 世界! 🎉 naïve café — the "),
    (["not there"], TEXT),
    (["the end.!"], TEXT),  # a stop string's start at the very end is released when the text ends
])
def test_text_is_cut_before_the_first_stop_string(tokenizer, stop, expected):
    for ids in (tokenizer.encode(TEXT), byte_ids(tokenizer, TEXT)):
        pieces, detokenizer = run(tokenizer, ids, stop)
        assert "".join(pieces) == detokenizer.text == expected
        assert detokenizer.stopped == (expected != TEXT)


def test_a_possible_stop_string_is_held_back_then_released(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, ["abc"])
    a, b, x = (tokenizer.encode(letter)[0] for letter in "abx")
    assert detokenizer.feed(a) == "" and detokenizer.feed(b) == ""  # "ab" may begin "abc"
    assert detokenizer.feed(x) == "abx"
    assert detokenizer.offset == 3 and not detokenizer.stopped


def test_ids_past_the_vocabulary_and_special_tokens_have_no_text(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer)
    im_end = tokenizer.encode("<|im_end|>")
    assert len(im_end) == 1
    assert detokenizer.feed(tokenizer.vocab_size + 5) == "" and detokenizer.feed(im_end[0]) == ""
