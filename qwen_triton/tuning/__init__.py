"""Measured kernel picks and size thresholds, one table per GPU (`h200.py`).

A kernel file holds its kernel, its config space and its launcher; where an in-graph sweep found a config the
autotuner's one-launch timing misses, the pick comes from here. `active()` is the table of the GPU this process
runs on, read once by the kernel modules at import:
- a GPU with a table (its name names it, e.g. "NVIDIA H200"): that table; an H100 takes the H200's (the same
  Hopper SM count and shared memory: the pins are the same kernels' tiles, and its HBM only slower);
- under the interpreter or without a GPU: the H200's (the reference table, so the CPU tests check its pins
  against the config spaces; the interpreter runs each space's first config anyway);
- any other GPU: `DEFAULT`, the H200's size thresholds and no picks, so every kernel autotunes over its whole
  config space (never an error). QWEN_TRITON_TUNING=h200|default names a table explicitly.

Beside the tables, `picks.py`: the autotuner's own picks recorded per GPU (`qwen-triton tune`), so that the keys
no table pins do not autotune on a first start either.

To tune a new GPU: run the sweeps in benchmarks/ (decode_sweep.py, gemm_sweep.py, chunk_sweep.py,
prefill_options.py) on it, write `<gpu>.py` with a `TABLE = Tuning(...)` of its winners, and add it to TABLES.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    """Picks (config settings, None: autotune over the whole space) and thresholds, by kernel and size bucket.
    A pick table by size is ((largest size served, or None for any, (value per field)), ...)."""

    name: str
    # linear.gemv: (SPLIT_K, BLOCK_N, BLOCK_K) by the largest K served
    gemv_by_k: tuple | None
    # one sequence's decode projections run the GEMV (and the fused paths that read weights as it does: the layer
    # tail, the projected DeltaNet step) up to this hidden size; past it, the decode GEMM's smallest bucket, as a
    # step of several rows runs them (None: at every size)
    gemv_hidden_limit: int | None
    # below that limit, a decode step of up to this many rows runs its projections through the GEMV (a weight read
    # once a row) and the fused paths; more rows, the decode GEMM (a weight read once for all rows)
    gemv_most_rows: int
    # past gemv_most_rows and up to this many rows, a decode step's projections run the resident-weights GEMM (its
    # weights loaded before its PDL wait, linear/resident_gemm.py); more rows, the tiled decode GEMM
    resident_most_rows: int
    # linear.gemm: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) by K for prompts of up to MAX_SPLIT_ROWS tokens;
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by N from gemm_long_prompt_rows tokens on, and on the
    # TMA loads in the bucket gemm_medium_prompt_bucket
    gemm_by_k: tuple | None
    # linear.gemm for up to gemm_decode_rows rows (a decode step of several sequences, the shortest prompts):
    # (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) by K with BLOCK_M the bucket's rows (16 to 64), one pick
    # for every bucket, so that a row's result does not depend on how many rows share its step (None: autotune)
    gemm_decode_rows: int
    gemm_decode_by_k: tuple | None
    gemm_long_by_n: tuple | None
    gemm_medium_by_n: tuple | None
    gemm_long_prompt_rows: int
    gemm_medium_prompt_bucket: int
    gemm_tma_rows: int  # gemm(tma=None) loads through descriptors from this many rows on, where it can
    # conv.causal_conv1d: the prefill's pick below and from the length bucket conv_long_prefill_from
    conv_prefill_pick: dict | None
    conv_long_prefill_pick: dict | None
    conv_long_prefill_from: int
    # attention.qk_norm_rotary: the pick from the row bucket qk_long_rows_from
    qk_long_rows_pick: dict | None
    qk_long_rows_from: int
    # gated_delta_rule.chunk: chunks of 32 tokens up to short_chunk_tokens; kernel 1 split above
    # split_prepare_tokens; the picks by chunk size and kernel up to short_prompt_tokens, by kernel from
    # long_prompt_tokens
    chunk_short_chunk_tokens: int
    chunk_split_prepare_tokens: int
    chunk_short_prompt_tokens: int
    chunk_short_prompt_picks: dict
    chunk_long_prompt_tokens: int
    chunk_long_prompt_picks: dict
    # the engine (engine/plan.py): a prefill of up to prefill_pdl_tokens tokens launches with PDL (0: none);
    # the decode LM head with PDL or not; the screened head's batch limit
    prefill_pdl_tokens: int
    lm_head_pdl: bool
    screened_lm_head_pdl: bool
    screened_rows: int
    # lm_head.argmax's tiled kernel (a decode step's argmax and Gumbel heads past one row): (BLOCK_V, BLOCK_K,
    # num_warps, num_stages) by the largest bucket of rows served (None: autotune, some 4 s a key)
    lm_head_tiled_by_rows: tuple | None = None
    # linear.gemm in a decode step whose rows need not match their bits at other batch sizes (not batch_invariant):
    # ((bucket of rows, ((largest K served, (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)), ...)),
    # ...), where a bucket's own pick beats gemm_decode_by_k's one pick for every bucket (None or a bucket not
    # listed: gemm_decode_by_k)
    gemm_decode_by_rows: tuple | None = None


def without_picks(table: Tuning, name: str = "default") -> Tuning:
    """`table`'s thresholds with every pick removed: each kernel autotunes over its whole config space."""
    return dataclasses.replace(table, name=name, gemv_by_k=None, gemm_by_k=None, gemm_decode_by_k=None, gemm_long_by_n=None,
                               gemm_medium_by_n=None, conv_prefill_pick=None, conv_long_prefill_pick=None,
                               qk_long_rows_pick=None, chunk_short_prompt_picks={}, chunk_long_prompt_picks={},
                               lm_head_tiled_by_rows=None, gemm_decode_by_rows=None)


from .h200 import TABLE as H200  # noqa: E402  (h200.py imports Tuning from here)

DEFAULT = without_picks(H200)
TABLES = {"h200": H200, "default": DEFAULT}


HOPPER_NAMES = ("H200", "H100")  # the H200's pins serve the H100 too (docs/decisions.md, D144)


def for_device_name(name: str) -> Tuning:
    """The table of a GPU by its name (torch.cuda.get_device_name), DEFAULT for one without a table."""
    return H200 if any(part in name.upper() for part in HOPPER_NAMES) else DEFAULT


def _resolve() -> Tuning:
    setting = os.environ.get("QWEN_TRITON_TUNING", "")
    if setting:
        if setting not in TABLES:
            raise ValueError(f"QWEN_TRITON_TUNING={setting!r}: expected one of {', '.join(TABLES)}")
        return TABLES[setting]
    import torch

    from ..operators.common import interpreting

    if interpreting() or not torch.cuda.is_available():
        return H200
    return for_device_name(torch.cuda.get_device_name())


_ACTIVE: list[Tuning] = []


def active() -> Tuning:
    """The table of this process's GPU (see the module docstring), resolved once."""
    if not _ACTIVE:
        _ACTIVE.append(_resolve())
    return _ACTIVE[0]
