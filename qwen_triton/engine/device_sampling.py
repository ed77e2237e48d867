"""Sampling glue of the Triton backend: a batch's sampling parameters as device tensors, the decode mode they
need, and the first token's choice from a prefill's logits (the decode step chooses the others inside its CUDA
graph).

The modes, each a fixed list of kernels after the layers (so a CUDA graph per mode):
  greedy            the screened (or plain) argmax LM head
  temperature       the Gumbel-max LM head (no logits written)
  min-p             the logits, then sample's stats and draw kernels (min-p needs no search pass)
  top-k             the logits, then sample's top-k candidates and draw kernels (every sampled row has
                    0 < top_k <= K_MAX; top-p and min-p over the candidates): 2 launches. Up to the plan's
                    screened rows the logits come from the screened top-k head (lm_head/screened_top_k.py:
                    exact at every token the top k can hold, from the int8 head), which chooses the same ids
  sample            the logits, then sample with its top-k / top-p search passes: 14 launches
  penalized         the logits, the penalties kernel, sample's stats and draw, the counting kernel
  penalized-top-k   the logits, the penalties kernel, sample's top-k candidates and draw, the counting kernel;
                    behind the screened top-k head, no penalties kernel: the head applies them to its candidates
  penalized-sample  the logits, the penalties kernel, sample with its search passes, the counting kernel
The top-k modes choose the ids the search modes would (operators/sampling/sample.py); they run at one candidate
width, K_MAX, whatever the batch's largest top_k, so the mode alone names the launch list (and the CUDA graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..operators.sampling import K_MAX, apply_penalties, count_tokens, sample
from .buffers import host_to_device

PENALIZED_MODES = ("penalized", "penalized-top-k", "penalized-sample")
SEARCH_MODES = ("sample", "penalized-sample")  # sample's top-k / top-p search passes
TOP_K_MODES = ("top-k", "penalized-top-k")  # sample's top-k candidates
LOGITS_MODES = ("min-p", "top-k", "sample") + PENALIZED_MODES  # the LM head writes logits, sample chooses


def sample_options(mode: str) -> dict:
    """sample's keyword arguments for a mode's filters: the search passes, the top-k candidates (at the width
    K_MAX), or neither (min-p alone, or none)."""
    top_k = mode in TOP_K_MODES
    return dict(filtering=mode in SEARCH_MODES or top_k, top_k_bound=K_MAX if top_k else None)


FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
INT_COLUMNS = ("top_k", "seed")


def _column_widths(count: int) -> tuple[int, int]:
    """Elements a float32 and an int64 column take in the buffer: each column starts 16 bytes aligned, as a tensor of
    its own does, so a kernel reading it compiles the specialisation the warm-up compiled."""
    return -(-count // 4) * 4, -(-count // 2) * 2


def _buffer_bytes(count: int) -> int:
    floats, ints = _column_widths(count)
    return 4 * floats * len(FLOAT_COLUMNS) + 8 * ints * len(INT_COLUMNS)


def _columns(buffer: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 [6, count] and int64 [2, count] views of a byte buffer of DeviceSampling's columns (each row
    contiguous and 16 bytes aligned)."""
    floats, ints = _column_widths(count)
    split = 4 * floats * len(FLOAT_COLUMNS)
    return (buffer[:split].view(torch.float32).view(len(FLOAT_COLUMNS), floats)[:, :count],
            buffer[split:].view(torch.int64).view(len(INT_COLUMNS), ints)[:, :count])


@dataclass
class DeviceSampling:
    """The sampling parameters of a batch's rows as device tensors, and the decode mode they need."""

    mode: str  # one of the module's modes
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    presence_penalty: torch.Tensor

    @classmethod
    def build(cls, rows, device) -> "DeviceSampling":
        """rows: one SamplingParams per batch row."""
        sampled = [p for p in rows if p.temperature > 0]  # greedy rows ignore the filters
        candidates = all(0 < p.top_k <= K_MAX for p in sampled)  # every sampled row's top-k by candidates
        if any(p.penalized for p in rows):
            if not any(p.top_k > 0 or p.top_p < 1.0 for p in sampled):
                mode = "penalized"
            else:
                mode = "penalized-top-k" if candidates else "penalized-sample"
        elif not sampled:
            mode = "greedy"
        elif all(p.top_k == 0 and p.top_p >= 1.0 for p in rows):
            mode = "min-p" if any(p.min_p > 0 for p in sampled) else "temperature"
        else:
            mode = "top-k" if candidates else "sample"

        # every column in one host buffer and one copy (pinned, not waiting for the GPU: a server builds this
        # while a step runs), then views of the device's copy
        count, device = len(rows), torch.device(device)
        host = torch.zeros(_buffer_bytes(count), dtype=torch.uint8, pin_memory=device.type == "cuda")
        floats, ints = _columns(host, count)
        floats.copy_(torch.tensor([[getattr(p, name) for p in rows] for name in FLOAT_COLUMNS], dtype=torch.float32))
        ints.copy_(torch.tensor([[getattr(p, name) for p in rows] for name in INT_COLUMNS], dtype=torch.int64))
        floats, ints = _columns(host_to_device(host, device), count)
        named = dict(zip(FLOAT_COLUMNS, floats))
        return cls(mode=mode, top_k=ints[0].to(torch.int32), seed=ints[1], **named)

    def penalties(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.repetition_penalty[rows], self.frequency_penalty[rows], self.presence_penalty[rows]


def lm_argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice from materialised logits: the sampler at temperature 0 (argmax, lowest id on ties)."""
    rows = logits.shape[0]
    zeros = torch.zeros(rows, device=logits.device)
    return sample(logits, zeros, torch.zeros(rows, device=logits.device, dtype=torch.int32),
                  torch.ones(rows, device=logits.device), torch.zeros(1, device=logits.device, dtype=torch.int64),
                  torch.zeros(rows, device=logits.device, dtype=torch.int64), filtering=False)


def choose_first(logits: torch.Tensor, sampling: DeviceSampling, row: int | None = None,
                 counts: torch.Tensor | None = None, prompt_mask: torch.Tensor | None = None,
                 slots: torch.Tensor | None = None) -> torch.Tensor:
    """The first generated ids from prefill logits, drawn as decode draws (same noise stream at step 0): of row
    `row` (logits [1, V]), or with row None of every row of the batch at once (logits [B, V], row r the batch's
    row r: one launch list for all of them, the same ids as one row at a time). In a penalized mode, counts and
    prompt_mask are the histories (zero counts, the prompts' tokens marked): the row's [1, V] views, or [S, V]
    with slots int32 [B] naming each row's; the penalties apply to a copy of the logits, and the chosen ids are
    counted."""
    if sampling.mode == "greedy":
        return lm_argmax_rows(logits)
    pick = slice(None) if row is None else slice(row, row + 1)
    if sampling.mode in PENALIZED_MODES:
        if counts is None or prompt_mask is None:
            raise ValueError(f"mode {sampling.mode!r} needs the rows' counts and prompt_mask")
        logits = apply_penalties(logits.float().clone(), counts, prompt_mask, *sampling.penalties(pick), slots=slots)
    step = torch.zeros(logits.shape[0], device=logits.device, dtype=torch.int64)
    chosen = sample(logits, sampling.temperature[pick], sampling.top_k[pick], sampling.top_p[pick],
                    sampling.seed[pick], step, min_p=sampling.min_p[pick] if sampling.mode != "temperature" else None,
                    **sample_options(sampling.mode))
    if sampling.mode in PENALIZED_MODES:
        count_tokens(chosen, counts, slots=slots)
    return chosen
