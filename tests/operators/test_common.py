"""The operators' shared helpers: pin tables, config pins, device capabilities."""

from __future__ import annotations

import triton

from qwen_triton.operators.common import hopper_or_later, keep_preferred, pdl_available, preferred_entry


def test_preferred_entry_takes_the_first_entry_that_serves_the_size():
    table = ((1024, (64, 1)), (2048, (128, 4)), (None, (256, 8)))
    fields = ("BLOCK_N", "SPLIT_K")
    assert preferred_entry(table, 1024, fields) == {"BLOCK_N": 64, "SPLIT_K": 1}
    assert preferred_entry(table, 1025, fields) == {"BLOCK_N": 128, "SPLIT_K": 4}
    assert preferred_entry(table, 10**6, fields) == {"BLOCK_N": 256, "SPLIT_K": 8}
    assert preferred_entry(table[:2], 4096, fields) is None  # no entry serves it
    assert preferred_entry(None, 1024, fields) is None  # no table


def test_keep_preferred():
    configs = [triton.Config({"BLOCK_N": n}, num_warps=w) for n, w in ((64, 4), (128, 4), (128, 8))]
    assert keep_preferred(configs, {"BLOCK_N": 128, "num_warps": 8}) == [configs[2]]
    assert keep_preferred(configs, {"BLOCK_N": 128}) == configs[1:]
    assert keep_preferred(configs, {"BLOCK_N": 32}) == configs  # none matches: all
    assert keep_preferred(configs, None) == configs  # no pin: all


def test_no_hopper_features_off_a_gpu():
    assert not hopper_or_later("cpu")
    assert not pdl_available("cpu")
