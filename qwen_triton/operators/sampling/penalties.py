"""Repetition, frequency and presence penalties on materialised logits, in place, and the generated-token counts
they read, kept on the device (so a decode step's CUDA graph replays both).

Per row r, token t (vLLM's and OpenAI's semantics), with count[t] the times t was generated so far in the row's
sequence and prompt[t] whether t is in its prompt (the history of slot s = slots[r], the row's sequence):
    seen  = prompt[t] or count[t] > 0
    x     = logits[r, t]
    x     = x / R if x > 0 else x * R          where seen             (R = repetition_penalty, 1.0 = off)
    x     = x - F * count[t] - P               where count[t] > 0     (F = frequency, P = presence, 0 = off)
A row with every penalty off is skipped (its logits are left bit for bit); in a penalised row a token neither
seen nor counted is left as it is.

Shapes: logits float32 [M, V] (rows may be strided), counts int32 [S, V] and prompt_mask bool [S, V], the
histories of S >= M sequence slots, row r's at slots[r] (int32 [M] on the device, distinct; None: row r is slot
r; a negative slot is a padding row, skipped: operators/common.py), repetition / frequency / presence float32 [M].
count_tokens: counts[slots[r], chosen[r]] += 1 for r < M, chosen int64 [M] (after the step chose its ids).

Floor, per penalised row: 4*V bytes of logits read and written, 4*V of counts and V of the mask read (13*V: 3.2
MB at V = 248320, ~0.7 us of HBM); count_tokens 16 bytes a row. In a decode step both are a launch each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import check_same_device, check_slots, check_tensor, interpreting, sequence_slot


@triton.jit
def penalized_row(slot, repetition, frequency, presence):
    """Whether a row's penalties change any logit: a live row (not padding) with a penalty on."""
    return (slot >= 0) & ((repetition != 1.0) | (frequency != 0.0) | (presence != 0.0))


@triton.jit
def penalized_logit(logit, count, in_prompt, repetition, frequency, presence):
    """The penalised logit of a token of a penalised row (the module's formula; untouched when neither counted nor
    in the prompt): the one arithmetic of every kernel that applies the penalties (lm_head/screened_top_k.py applies
    it to its candidates), so they agree bit for bit."""
    counted = count > 0
    repeated = tl.where(logit > 0, logit / repetition, logit * repetition)
    logit = tl.where(in_prompt | counted, repeated, logit)  # x / 1.0 and x * 1.0 are x exactly
    return tl.where(counted, logit - frequency * count.to(tl.float32) - presence, logit)


@triton.jit
def _penalties_kernel(
    logits_ptr, stride_lm, counts_ptr, stride_cm, prompt_ptr, stride_pm,
    repetition_ptr, frequency_ptr, presence_ptr, slots_ptr, V,
    BLOCK_V: tl.constexpr, HAS_SLOTS: tl.constexpr,
):
    block = tl.program_id(0)
    row = tl.program_id(1)
    slot = sequence_slot(slots_ptr, row, HAS_SLOTS)
    repetition = tl.load(repetition_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    presence = tl.load(presence_ptr + row)
    if penalized_row(slot, repetition, frequency, presence):
        offs = block * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = offs < V
        row64 = row.to(tl.int64)
        slot64 = slot.to(tl.int64)
        logit = tl.load(logits_ptr + row64 * stride_lm + offs, mask=mask, other=0.0)
        count = tl.load(counts_ptr + slot64 * stride_cm + offs, mask=mask, other=0)
        in_prompt = tl.load(prompt_ptr + slot64 * stride_pm + offs, mask=mask, other=0) != 0
        logit = penalized_logit(logit, count, in_prompt, repetition, frequency, presence)
        tl.store(logits_ptr + row64 * stride_lm + offs, logit, mask=mask)


@triton.jit
def _count_kernel(chosen_ptr, counts_ptr, stride_cm, slots_ptr, rows, V, BLOCK: tl.constexpr,
                  HAS_SLOTS: tl.constexpr):
    row = tl.arange(0, BLOCK)
    mask = row < rows
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + row, mask=mask, other=-1)
    else:
        slot = row
    token = tl.load(chosen_ptr + row, mask=mask, other=0)
    # a padding row (negative slot), or a row whose logits had no valid token, counts nothing
    mask = mask & (slot >= 0) & (token >= 0) & (token < V)
    where = counts_ptr + slot.to(tl.int64) * stride_cm + token
    tl.store(where, tl.load(where, mask=mask, other=0) + 1, mask=mask)


# GPU: 1024 tokens a program (243 programs a row of 248320); the interpreter: tiny tiles for the tests' small
# rows (several programs a row), tiles of a quarter of a long row (it pays per operation, not per element).
BLOCK_V = 16 if interpreting() else 1024
NUM_WARPS = 4
INTERPRETER_WIDE_V = 4096


def _block(V: int) -> int:
    if interpreting() and V > INTERPRETER_WIDE_V:
        return triton.next_power_of_2(triton.cdiv(V, 4))
    return BLOCK_V


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                    slots: torch.Tensor | None = None) -> torch.Tensor:
    """In place on logits float32 [M, V]: the penalties of each row (see the module). counts int32 [S, V] and
    prompt_mask bool [S, V] (S >= M slots' histories, row r's at slots[r]; slots None: row r's at r),
    repetition / frequency / presence float32 [M] (1.0 / 0 / 0 = off). Returns logits."""
    check_tensor("logits", logits, shape=(None, None), dtype=torch.float32)
    M, V = logits.shape
    check_tensor("counts", counts, shape=(None, V), dtype=torch.int32)
    if counts.shape[0] < M:
        raise ValueError(f"counts has shape {list(counts.shape)}: fewer rows than logits' {M}")
    check_tensor("prompt_mask", prompt_mask, shape=tuple(counts.shape), dtype=torch.bool)
    for name, tensor in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
        check_tensor(name, tensor, shape=(M,), dtype=torch.float32)
    slots, has_slots = check_slots(slots, M, logits)
    check_same_device(logits=logits, counts=counts, prompt_mask=prompt_mask, repetition=repetition,
                      frequency=frequency, presence=presence, slots=slots)
    if M == 0 or V == 0:
        return logits
    block = _block(V)
    _penalties_kernel[(triton.cdiv(V, block), M)](
        logits, logits.stride(0), counts, counts.stride(0), prompt_mask.view(torch.uint8), prompt_mask.stride(0),
        repetition, frequency, presence, slots, V, BLOCK_V=block, HAS_SLOTS=has_slots, num_warps=NUM_WARPS,
    )
    return logits


def count_tokens(chosen: torch.Tensor, counts: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
    """In place: counts[slots[r], chosen[r]] += 1 for each row r of chosen int64 [M] (slots int32 [M], distinct,
    negative: a padding row, not counted; None: row r's count at r); counts int32 [S, V], S >= M. Returns
    counts."""
    check_tensor("chosen", chosen, shape=(None,), dtype=torch.int64, contiguous=True)
    M = chosen.shape[0]
    check_tensor("counts", counts, shape=(None, None), dtype=torch.int32)
    if counts.shape[0] < M:
        raise ValueError(f"counts has shape {list(counts.shape)}: fewer rows than chosen's {M}")
    slots, has_slots = check_slots(slots, M, chosen)
    check_same_device(chosen=chosen, counts=counts, slots=slots)
    if M == 0:
        return counts
    _count_kernel[(1,)](chosen, counts, counts.stride(0), slots, M, counts.shape[1], BLOCK=triton.next_power_of_2(M),
                        HAS_SLOTS=has_slots)
    return counts

