"""Choosing each running sequence's next id: on the device inside the decode step (the triton backend), or on the
host from the logits (the reference backend).

The scheduler makes three calls: `start(sequence)` when the sequence gets its slot, `first(sequences, logits)` with
the logits [S, vocab] of the prompts whose prefill ended this step, and `decode(sequences)` for one step of every
running sequence. A sequence draws the same ids whatever batch it runs in and whatever runs beside it: each
sampled sequence draws from a stream of its own (its seed), advanced by its own step counter (its number of
generated ids), so concurrent requests give what the same requests give one at a time.

`DeviceSampler` (a backend with `decode_tokens`): the step's kernels choose the ids inside its CUDA graph, with the
penalties' history kept per slot on the device (`history.start` from the prompt when the sequence gets its slot);
the host reads the ids only. The step's parameters (DeviceSampling: the rows' device tensors and the mode they
need) are built when the batch's composition changes, not every step; while it stays the same, each step continues
from the ids, positions and step counters the step before fed back on the device (feedback=True), so a step takes
no input from the host. A step with a row that asks for log-probabilities needs the logits: it runs the backend's
`decode` and chooses the ids from them with the same kernels the decode step runs after its LM head (penalties,
sample, counting), so a sequence's ids do not depend on whether a row beside it asked for log-probabilities.

`HostSampler` (any other backend): engine/sampling.py's functions on the float32 logits of `decode(token_ids,
positions, slots=...)`, each sequence with its own torch.Generator seeded with its seed, as `LLM.generate` draws on
the reference backend.

Log-probabilities are those of the model's own distribution (log-softmax of the raw logits, before penalties and
temperature), as vLLM reports them.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import torch

from ..engine.buffers import host_to_device
from ..engine.sampling import SamplingParams, penalize, sample, token_counts
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


def make_sampler(backend):
    """The sampler of a backend: on the device where it chooses ids there (decode_tokens), else on the host."""
    return DeviceSampler(backend) if hasattr(backend, "decode_tokens") else HostSampler(backend)


def logprob_outputs(outputs: list[SequenceOutput], logits: torch.Tensor, sequences: list[Sequence]) -> None:
    """Add the log-probability of each output's id, and those of the likeliest ids, to the rows that ask for them
    (row r of logits [B, vocab]: sequences[r]; outputs with an error are left alone). One host read."""
    rows = [r for r, s in enumerate(sequences) if s.logprobs is not None and outputs[r].error is None]
    if not rows:
        return
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = torch.tensor([outputs[r].token_id for r in rows], device=logits.device)
    top = max(sequences[r].logprobs for r in rows)
    values, ids = torch.topk(logprobs, top) if top else (logprobs[:, :0], logprobs[:, :0].long())
    picked = logprobs.gather(1, chosen[:, None])[:, 0]
    picked, values, ids = picked.tolist(), values.tolist(), ids.tolist()
    for index, r in enumerate(rows):
        count = sequences[r].logprobs
        outputs[r].logprob = picked[index]
        outputs[r].top_logprobs = list(zip(ids[index][:count], values[index][:count]))


# ---- on the host ------------------------------------------------------------------------------------
@dataclass
class RowState:
    """One sequence's sampling state on the host: its seeded generator (None when greedy) and, when a penalty is
    on, the mask of its prompt's ids and the counts of the ids generated so far."""

    generator: torch.Generator | None
    prompt_mask: torch.Tensor | None
    counts: torch.Tensor | None


class HostSampler:
    """Next ids from materialised logits, each sequence with its own SamplingParams and its own generator
    (seeded with its seed), so a sequence draws the same ids whatever batch it runs in and equals
    `LLM.generate` on the reference backend. Greedy rows without penalties share one argmax."""

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

    def first(self, sequences: list[Sequence], logits: torch.Tensor) -> list[SequenceOutput]:
        """The first generated id of each sequence from its prompt's last logits (row r of [S, vocab])."""
        return self.choose(logits, sequences)

    def decode(self, sequences: list[Sequence], ahead: bool = False) -> list[SequenceOutput]:
        """One decode step for `sequences` (each at its last generated id, in its slot): one output each (ahead: the
        device sampler's hint, nothing to run ahead here)."""
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
            outputs.append(SequenceOutput(token))
        logprob_outputs(outputs, logits, sequences)
        return outputs


# ---- on the device ----------------------------------------------------------------------------------
def device_params(params: SamplingParams) -> SamplingParams:
    """params with its seed as the int64 the device keeps (the same 64 bits: the API takes seeds up to 2^64 - 1)."""
    seed = params.seed % 2**64
    return dataclasses.replace(params, seed=seed - 2**64 if seed >= 2**63 else seed)


class DeviceSampler:
    """Next ids chosen on the device by the backend's decode step (TritonModel.decode_tokens), or, for a step with
    a row that asks for log-probabilities, by the same kernels from the logits of its `decode`.

    With `ahead` (the default on a GPU) a step whose batch the scheduler expects to run again (decode(...,
    ahead=True): no prompt is waiting to join) launches the next step of the same batch, continuing on the device,
    before the host reads its own ids, as engine/decode_pipeline.py does for LLM.generate: the GPU then runs while
    the host handles the step's outputs (the HTTP side's work included). Only where every row has room for two more
    ids; a row that ends at a stop id meanwhile has its extra id dropped (its slot is reset before it serves another
    sequence: the stream runs in order). The next decode reads the step launched ahead."""

    def __init__(self, backend, ahead: bool | None = None):
        from ..engine.device_sampling import PENALIZED_MODES

        self.backend = backend
        self.device = backend.device
        self.vocab = backend.config.vocab_size
        self.ahead = self.device.type == "cuda" if ahead is None else ahead
        self._decode = slotted_decode(backend)
        self._penalized_modes = PENALIZED_MODES
        # an event per step in flight (the one read, the one launched ahead), used in turn
        self._events = [torch.cuda.Event() if self.device.type == "cuda" else None for _ in range(2)]
        self._launched = 0
        # the batch the last step ran: its sequences' identities in row order, and its DeviceSampling
        self._batch: tuple[int, ...] = ()
        self._sampling = None
        # whether the last step ran this batch with feedback: the next one then continues on the device
        self._continues = False
        # a step launched ahead, not yet read: (its event's index, its rows' step counters before it)
        self._pending: tuple[int, list[int]] | None = None

    def start(self, sequence: Sequence) -> None:
        params = device_params(sequence.params)
        sequence.sampling_state = params
        if params.penalized:  # the slot's history: the prompt's ids marked, nothing counted
            self.backend.history.start(sequence.slot, torch.tensor(sequence.prompt_ids))

    def first(self, sequences: list[Sequence], logits: torch.Tensor) -> list[SequenceOutput]:
        """The first generated id of each sequence (its step 0) from its prompt's last logits (row r of [S, vocab]),
        drawn as a decode step draws it."""
        from ..engine.device_sampling import DeviceSampling

        sampling = DeviceSampling.build([s.sampling_state for s in sequences], self.device)
        steps = torch.zeros(len(sequences), dtype=torch.int64, device=self.device)
        slots = host_to_device(torch.tensor([s.slot for s in sequences], dtype=torch.int32), self.device)
        return self._choose(logits, sequences, sampling, steps, slots)

    def decode(self, sequences: list[Sequence], ahead: bool = False) -> list[SequenceOutput]:
        """One decode step for `sequences` (each at its last generated id, in its slot): one output each. ahead: the
        scheduler expects the same sequences (or fewer) in the next step (see the class)."""
        from ..engine.device_sampling import DeviceSampling

        if self._pending is not None:
            outputs = self._read_pending(sequences, ahead)
            if outputs is not None:
                return outputs
        batch = tuple(s.identity for s in sequences)
        if batch != self._batch:
            self._batch = batch
            self._sampling = DeviceSampling.build([s.sampling_state for s in sequences], self.device)
            self._continues = False
        steps = [len(s.generated) for s in sequences]
        if any(s.logprobs is not None for s in sequences):
            token_ids, positions, step_counts, slots = self._inputs(sequences, steps)
            self._continues = False  # decode loads its own inputs into the step's buffers
            logits = self._decode(token_ids, positions, slots)
            return self._choose(logits, sequences, self._sampling, step_counts, slots.to(torch.int32))
        if self._continues:
            index = self._launch()
        else:
            token_ids, positions, step_counts, slots = self._inputs(sequences, steps)
            index = self._launch(token_ids, positions, step_counts, slots)
        if ahead and self._may_run_ahead(sequences):
            self._pending = (self._launch(), [step + 1 for step in steps])
        return self._read(index, steps)

    def _may_run_ahead(self, sequences: list[Sequence]) -> bool:
        """Whether the step after this one may be launched now: each row has room for its id of this step and the
        next (its budget, within the context), and none asks for log-probabilities."""
        return self.ahead and all(len(s.generated) + 2 <= s.budget and s.logprobs is None for s in sequences)

    def _launch(self, token_ids=None, positions=None, step_counts=None, slots=None) -> int:
        """Launch a step of the current batch with feedback (from the host's inputs, else continuing from the step
        before); the index of the event recorded after it."""
        self.backend.decode_tokens(token_ids, positions, self._sampling, step_counts, feedback=True, slots=slots)
        self._continues = True
        index = self._launched % 2
        self._launched += 1
        if self._events[index] is not None:
            self._events[index].record()
        return index

    def _read(self, index: int, steps: list[int]) -> list[SequenceOutput]:
        """The ids of the step behind event `index`, of the current batch's rows (step counters `steps` before it):
        the feedback kernel leaves row r's id in pinned host memory, in row (its step counter) % 2."""
        if self._events[index] is not None:
            self._events[index].synchronize()
        rows = self.backend.chosen_on_host(len(steps)).tolist()
        vocab = self.vocab
        return [SequenceOutput(token) if 0 <= token < vocab else SequenceOutput(None, error=NON_FINITE)
                for token in (rows[step % 2][r] for r, step in enumerate(steps))]

    def _read_pending(self, sequences: list[Sequence], ahead: bool) -> list[SequenceOutput] | None:
        """The outputs of the step launched ahead for `sequences` (the rows of its batch still running), launching
        the one after it first where the batch is unchanged; None where none of them ran in it (every sequence of
        its batch ended meanwhile: the step is waited for and dropped)."""
        index, steps = self._pending
        self._pending = None
        rows = {identity: row for row, identity in enumerate(self._batch)}
        if not any(s.identity in rows for s in sequences):
            self._read(index, steps)
            return None
        if any(s.identity not in rows for s in sequences):
            raise RuntimeError("a sequence joined the batch while a step of it ran ahead: the scheduler must not ask "
                               "for a step ahead while prompts are waiting to join")
        unchanged = len(sequences) == len(self._batch)
        if unchanged and ahead and self._may_run_ahead(sequences):
            self._pending = (self._launch(), [step + 1 for step in steps])
        outputs = self._read(index, steps)
        return outputs if unchanged else [outputs[rows[s.identity]] for s in sequences]

    def _inputs(self, sequences: list[Sequence], steps: list[int]) -> tuple[torch.Tensor, ...]:
        """(token ids, positions, step counters, slots) [B] each, on the device in one copy."""
        packed = host_to_device(torch.tensor([[s.generated[-1] for s in sequences], [s.position for s in sequences],
                                              steps, [s.slot for s in sequences]], dtype=torch.int64), self.device)
        return packed[0], packed[1], packed[2], packed[3]


    def _choose(self, logits: torch.Tensor, sequences: list[Sequence], sampling, steps: torch.Tensor,
                slots: torch.Tensor) -> list[SequenceOutput]:
        """The ids the decode step's kernels after its LM head choose, from logits [B, vocab] (row r: sequences[r]
        in slot slots[r], int32, at step counter steps[r]): the penalties (the slots' history, then counting the
        chosen ids), then sample in the mode's form. A row with a NaN or an infinity gets an error."""
        from ..engine.device_sampling import lm_argmax_rows, sample_options
        from ..operators.sampling import apply_penalties, count_tokens
        from ..operators.sampling import sample as sample_on_device

        finite = torch.isfinite(logits).all(-1)
        wanted = any(s.logprobs is not None for s in sequences)
        penalized = sampling.mode in self._penalized_modes
        if penalized:
            counts, prompt_mask = self.backend.history.tensors()
            chosen_from = logits.clone() if wanted else logits  # the log-probabilities are of the raw logits
            chosen_from = apply_penalties(chosen_from, counts, prompt_mask, *sampling.penalties(slice(None)),
                                          slots=slots)
        else:
            chosen_from = logits
        if sampling.mode == "greedy":
            chosen = lm_argmax_rows(chosen_from)
        else:
            chosen = sample_on_device(chosen_from, sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed,
                                      steps, min_p=None if sampling.mode == "temperature" else sampling.min_p,
                                      **sample_options(sampling.mode))
        if penalized:
            count_tokens(chosen, counts, slots=slots)
        vocab = self.vocab  # a step over NaN or infinite logits chooses no id of the vocabulary
        outputs = [SequenceOutput(token) if 0 <= token < vocab else SequenceOutput(None, error=NON_FINITE)
                   for token in torch.where(finite, chosen, -1).tolist()]
        logprob_outputs(outputs, logits, sequences)
        return outputs
