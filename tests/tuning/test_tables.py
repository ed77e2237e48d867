"""The H200's table holds exactly the picks and thresholds the kernel files held before they moved to
tuning/h200.py (the literal values, so an edit of the table is a visible change here), the kernels read it, and a
GPU without a table autotunes over every config."""

import importlib

import triton

from qwen_triton import tuning
from qwen_triton.operators.common import keep_preferred

# the modules (the packages export the launchers under the same names)
qk_norm_rotary = importlib.import_module("qwen_triton.operators.attention.qk_norm_rotary")
causal_conv1d = importlib.import_module("qwen_triton.operators.conv.causal_conv1d")
chunk = importlib.import_module("qwen_triton.operators.gated_delta_rule.chunk")
gemm = importlib.import_module("qwen_triton.operators.linear.gemm")
gemv = importlib.import_module("qwen_triton.operators.linear.gemv")


def test_the_h200_table_holds_the_values_the_kernels_were_tuned_with():
    h200 = tuning.H200
    assert h200.gemv_by_k == ((1024, (1, 16, 256)), (2048, (1, 8, 1024)), (None, (4, 16, 512)))
    assert h200.gemm_by_k == ((1024, (64, 64, 64, 1)), (None, (64, 64, 128, 4)))
    assert h200.gemm_decode_rows == 128
    assert h200.gemm_decode_by_k == ((1024, (64, 128, 1, 4, 4)), (2048, (32, 256, 2, 4, 3)), (2560, (32, 128, 1, 4, 4)),
                                     (None, (32, 128, 4, 4, 4)))
    assert h200.gemv_hidden_limit == 2048 and h200.gemv_most_rows == 1 and h200.resident_most_rows == 16
    assert h200.gemm_long_by_n == ((1024, (128, 256, 64, 8, 3)), (None, (128, 128, 64, 8, 3)))
    assert h200.gemm_medium_by_n == ((1024, (64, 128, 64, 4, 4)), (None, (128, 128, 64, 8, 3)))
    assert (h200.gemm_long_prompt_rows, h200.gemm_medium_prompt_bucket, h200.gemm_tma_rows) == (4096, 1024, 257)
    assert h200.conv_prefill_pick == dict(BLOCK_T=16, BLOCK_C=128, WALK_BLOCKS=0, num_warps=4)
    assert h200.conv_long_prefill_pick == dict(BLOCK_T=8, BLOCK_C=512, WALK_BLOCKS=4, num_warps=4)
    assert h200.conv_long_prefill_from == 1024
    assert h200.qk_long_rows_pick == dict(ROWS=4, num_warps=1) and h200.qk_long_rows_from == 1024
    assert (h200.chunk_short_chunk_tokens, h200.chunk_split_prepare_tokens) == (1024, 2048)
    assert (h200.chunk_short_prompt_tokens, h200.chunk_long_prompt_tokens) == (256, 4096)
    assert h200.chunk_short_prompt_picks == {
        64: {"prepare": dict(num_warps=8, num_stages=3), "state": dict(BLOCK_V=16, num_warps=4, num_stages=2),
             "output": dict(BLOCK_V=128, num_warps=4, num_stages=3)},
        32: {"prepare": dict(num_warps=4, num_stages=3), "state": dict(BLOCK_V=32, num_warps=8, num_stages=3),
             "output": dict(BLOCK_V=128, num_warps=4, num_stages=3)},
    }
    assert h200.chunk_long_prompt_picks == {"inverse": dict(num_warps=4, num_stages=3, maxnreg=168),
                                            "products": dict(num_warps=4, num_stages=3, maxnreg=None)}
    assert (h200.prefill_pdl_tokens, h200.lm_head_pdl, h200.screened_lm_head_pdl, h200.screened_rows) == \
        (256, False, True, 16)


def test_the_kernels_read_the_active_table_which_is_the_h200s_here():
    table = tuning.active()
    assert table is tuning.H200  # under the interpreter
    assert gemv.PREFERRED_BY_K is table.gemv_by_k and gemm.PREFERRED_BY_K is table.gemm_by_k
    assert gemm.PREFERRED_DECODE_BY_K is table.gemm_decode_by_k and gemm.DECODE_ROWS == table.gemm_decode_rows
    assert gemm.PREFERRED_LONG_BY_N is table.gemm_long_by_n and gemm.TMA_ROWS == table.gemm_tma_rows
    assert causal_conv1d.LONG_PREFILL_PICK is table.conv_long_prefill_pick
    assert qk_norm_rotary.LONG_ROWS_PICK is table.qk_long_rows_pick
    assert chunk.SHORT_PROMPT_PICKS is table.chunk_short_prompt_picks
    assert chunk.SPLIT_PREPARE_TOKENS == table.chunk_split_prepare_tokens


def test_a_gpu_without_a_table_keeps_the_thresholds_and_autotunes_every_config(monkeypatch):
    assert tuning.for_device_name("NVIDIA H200") is tuning.H200
    assert tuning.for_device_name("NVIDIA H100 80GB HBM3") is tuning.H200  # the Hopper table (D144)
    default = tuning.for_device_name("NVIDIA A100-SXM4-80GB")
    assert default is tuning.DEFAULT and default.gemv_by_k is None and default.chunk_long_prompt_picks == {}
    assert default.chunk_split_prepare_tokens == tuning.H200.chunk_split_prepare_tokens
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": 1}, num_warps=4, num_stages=3)
               for n in (8, 16) for k in (256, 512)]
    assert gemv._prune(configs, {"K": 1024}) == [configs[2]]  # the H200's pick (16 x 256) alone
    monkeypatch.setattr(gemv, "PREFERRED_BY_K", default.gemv_by_k)
    assert gemv._prune(configs, {"K": 1024}) == configs
    monkeypatch.setattr(chunk, "SHORT_PROMPT_PICKS", default.chunk_short_prompt_picks)
    prune = chunk._prompt_pick("state")
    assert prune(configs, dict(chunk_bucket=2)) == configs


def test_every_decode_pin_is_in_the_gemm_config_space_at_every_block_m(monkeypatch):
    """A pin that matches no config of the space is ignored (keep_preferred keeps them all: the key autotunes); each
    of the H200's decode pins, at each BLOCK_M a decode bucket takes (16 to 64), is one config of the space."""
    monkeypatch.setattr(gemm, "autotune_configs", lambda configs: configs)  # the GPU's space, not the interpreter's
    space = gemm._configs(split=True)
    for _, values in tuning.H200.gemm_decode_by_k:
        pin = dict(zip(gemm.DECODE_FIELDS, values))
        for block_m in (16, 32, 64):
            kept = keep_preferred(space, dict(pin, BLOCK_M=block_m))
            assert len(kept) == 1 and kept is not space, (pin, block_m)
