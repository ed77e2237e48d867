"""Choosing each sequence's next id on the host, from the backend's float32 logits.

The scheduler makes three calls: `start(sequence)` when the sequence gets its slot, `first(sequence, logits)`
with the logits of its prompt's last position once its prefill is done, and `decode(sequences)` for one step
of every running sequence. `HostSampler` answers them with the backend's `decode(token_ids, positions,
slots=...)` and engine/sampling.py's functions; a sampler that chooses on the device inside the decode step
(TritonModel.decode_tokens) can take its place behind the same three calls.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..engine.sampling import penalize, sample, token_counts
from .sequence import Sequence, SequenceOutput

NON_FINITE = ("the model produced NaN or infinite logits for this sequence; refusing to sample from them "
              "(the weights or the inputs may be out of range)")


def slotted_decode(backend):
    """backend.decode in its `slots=` form (row r decodes the sequence in slot slots[r]), or a TypeError saying
    that this backend's decode has no such argument."""
    try:
        parameters = inspect.signature(backend.decode).parameters
    except (TypeError, ValueError):
        parameters = {}
    if "slots" not in parameters:
        raise TypeError(
            f"{type(backend).__name__}.decode has no slots= argument: the server decodes the running sequences "
            "in whichever slots they hold, which needs decode(token_ids, positions, slots=...)"
        )

    def decode(token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return backend.decode(token_ids, positions, slots=slots)

    return decode


@dataclass
class RowState:
    """One sequence's sampling state: its seeded generator (None when greedy) and, when a penalty is on, the
    mask of its prompt's ids and the counts of the ids generated so far."""

    generator: torch.Generator | None
    prompt_mask: torch.Tensor | None
    counts: torch.Tensor | None


class HostSampler:
    """Next ids from materialised logits, each sequence with its own SamplingParams and its own generator
    (seeded with its seed), so a sequence draws the same ids whatever batch it runs in and equals
    `LLM.generate` on the reference backend. Greedy rows without penalties share one argmax. Log-probabilities
    are those of the model's own distribution (log-softmax of the raw logits, before penalties and
    temperature), as vLLM reports them."""

    def __init__(self, backend):
        self.backend = backend
        self.device = backend.device
        self.vocab = backend.config.vocab_size
        self._decode = slotted_decode(backend)

    def start(self, sequence: Sequence) -> None:
        params = sequence.params
        generator = torch.Generator().manual_seed(params.seed) if params.temperature > 0 else None
        prompt_mask = counts = None
        if params.penalized:
            prompt_mask = token_counts(sequence.prompt_ids, self.vocab) > 0
            counts = torch.zeros(self.vocab, dtype=torch.int32)
        sequence.sampling_state = RowState(generator, prompt_mask, counts)

    def first(self, sequence: Sequence, logits: torch.Tensor) -> SequenceOutput:
        """The first generated id from the prefill's logits [1, vocab]."""
        return self.choose(logits[-1:], [sequence])[0]

    def decode(self, sequences: list[Sequence]) -> list[SequenceOutput]:
        """One decode step for `sequences` (each at its last generated id, in its slot): one output each."""
        device = self.device
        token_ids = torch.tensor([s.generated[-1] for s in sequences], dtype=torch.int64, device=device)
        positions = torch.tensor([s.position for s in sequences], dtype=torch.int64, device=device)
        slots = torch.tensor([s.slot for s in sequences], dtype=torch.int64, device=device)
        return self.choose(self._decode(token_ids, positions, slots), sequences)

    def choose(self, logits: torch.Tensor, sequences: list[Sequence]) -> list[SequenceOutput]:
        """One output per row of logits [B, vocab] (row r: sequences[r]); a row with a NaN or an infinity gets
        an error instead of an id."""
        finite = torch.isfinite(logits).all(-1).tolist()
        chosen: list[int | None] = [None] * len(sequences)
        plain = [r for r, s in enumerate(sequences)
                 if finite[r] and s.params.temperature == 0.0 and not s.params.penalized]
        if plain:
            for r, token in zip(plain, logits[plain].argmax(-1).tolist()):
                chosen[r] = token
        for r, sequence in enumerate(sequences):
            if not finite[r] or chosen[r] is not None:
                continue
            params, state = sequence.params, sequence.sampling_state
            row = logits[r:r + 1]
            if params.penalized:
                row = penalize(row, params, state.counts, state.prompt_mask)
            chosen[r] = int(sample(row, params, state.generator)[0])
        outputs = []
        for r, sequence in enumerate(sequences):
            token = chosen[r]
            if token is None:
                outputs.append(SequenceOutput(None, error=NON_FINITE))
                continue
            state = sequence.sampling_state
            if state.counts is not None:
                state.counts[token] += 1
            output = SequenceOutput(token)
            if sequence.logprobs is not None:
                self._add_logprobs(output, logits[r], sequence.logprobs)
            outputs.append(output)
        return outputs

    @staticmethod
    def _add_logprobs(output: SequenceOutput, logits: torch.Tensor, top: int) -> None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        output.logprob = float(logprobs[output.token_id])
        if top:
            values, ids = torch.topk(logprobs, top)
            output.top_logprobs = list(zip(ids.tolist(), values.tolist()))
        else:
            output.top_logprobs = []
