"""The byte count of a decode step against the hand count for the 0.8B config."""

from qwen_triton.benchmark.floor import decode_bytes, kv_cache_bytes_per_token, parameter_count, prefill_flops
from qwen_triton.checkpoint import PRESETS, official_config
from qwen_triton.config import parse_config

CONFIG = parse_config(official_config(PRESETS["0.8b"]))


def test_weight_bytes_match_the_hand_count():
    assert parameter_count(CONFIG) == 752_393_024
    assert decode_bytes(CONFIG, context=128).weights == 1_504_786_048


def test_state_and_cache_bytes():
    counted = decode_bytes(CONFIG, context=128)
    assert counted.recurrent_state == 2 * 18 * 16 * 128 * 128 * 4  # 18.9 MB read and written
    assert counted.conv_state == 2 * 18 * 6144 * 3 * 2
    assert kv_cache_bytes_per_token(CONFIG) == 12_288
    assert counted.kv_cache == 12_288 * 129
    assert 1.54e9 < counted.total < 1.55e9  # "about 1.54 GB per token"


def test_prefill_flops_grow_with_tokens_and_context():
    assert prefill_flops(CONFIG, 256) > 2 * prefill_flops(CONFIG, 128) - 2 * 248320 * 1024
    assert prefill_flops(CONFIG, 128, start=1000) > prefill_flops(CONFIG, 128)


def test_batched_decode_bytes_share_the_weights_and_add_each_rows_state_and_cache():
    one = decode_bytes(CONFIG, context=128)
    assert decode_bytes(CONFIG, context=128, batch=1) == one
    row = 2 * 18 * 16 * 128 * 128 * 4 + 2 * 18 * 6144 * 3 * 2 + 12_288 * 129  # one more row's states and KV
    for batch in (2, 16, 128):
        rows = decode_bytes(CONFIG, context=128, batch=batch)
        assert rows.weights == one.weights
        assert rows.total - one.total == (batch - 1) * row
        assert rows.recurrent_state == batch * one.recurrent_state and rows.kv_cache == batch * one.kv_cache


def test_decode_run_bytes_grow_the_context_a_token_a_step():
    from qwen_triton.benchmark.floor import decode_run_bytes

    assert decode_run_bytes(CONFIG, 128, steps=1, batch=4) == decode_bytes(CONFIG, 128, batch=4).total
    three = decode_run_bytes(CONFIG, 128, steps=3, batch=4)
    assert three == 3 * decode_bytes(CONFIG, 129, batch=4).total  # the mean context is the middle step's
    assert three - 3 * decode_bytes(CONFIG, 128, batch=4).total == 4 * 12_288 * (0 + 1 + 2)
