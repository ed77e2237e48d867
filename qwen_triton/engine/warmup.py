"""The warm-up: every kernel variant at every autotuning key a generation can reach, run once when `LLM(...)`
loads, so that no request compiles or autotunes (measured before it on the H200: a 1,764-token prompt of a bucket
never tuned on the machine took 27.8 s to its first token, BENCHMARKS.md, "Workloads through the API").

A kernel compiles once per specialisation (its constexprs and launch options, and for each other argument
Triton's class: an integer 1, a multiple of 16 or neither, a pointer 16-byte aligned or not) and autotunes once per
key (its key arguments and the dtypes of its tensors); Triton keeps both in memory for the process and on disk for
the machine. What a request's kernels compile and tune on is a function of a few numbers, and the warm-up runs one
case of each value they take up to the model's max_length and max_batch:

- A prefill of T tokens from position 0 (generation's: the logits of its last token only). Its keys take T's
  length bucket (T rounded up to a power of two: the GEMM's M, the attention's length and context, the chunked
  rule's chunk count; at most 4096 for the conv and the q/k norm, `plan.triton_bucket`), so a max_length past
  4096 brings buckets of its own (8192, ...) to the GEMMs, the attention and the chunked rule. Its variants
  change at the thresholds of the plan and of the tuning table (the GEMV up to 16 tokens, then the GEMM with the
  folded norm; split-K up to 256; the TMA loads from `gemm.TMA_ROWS`; PDL up to `plan.prefill_pdl_tokens`;
  chunks of 64 past `chunk.SHORT_CHUNK_TOKENS`, kernel 1 in two parts past `chunk.SPLIT_PREPARE_TOKENS`; the
  conv's, the q/k norm's and the picks' thresholds are length buckets). Its kernels specialise on T and on the
  chunk count (the Gluon state pass), its LM head on the alignment of the last row. `prefill_signature` is that
  tuple; `prefill_lengths` takes the longest length of each signature, a bucket's longest first, so that each
  bucket is tuned at its longest prompt. The prefills run in slot 0, and in any slot whose states differ from
  slot 0's in alignment (none at the presets' shapes).
- A packed prefill (engine/packed.py: `prefill_batch` of several prompts, and with CUDA graphs every prompt's
  last logits): its kernels' shapes, keys and specialisations are functions of its token bucket alone (the rows T,
  T's chunks; the layout, the lengths, starts and slots are device data), and its LM head's of its sequence bucket.
  The warm-up runs one pass per token bucket (one prompt of the bucket's length, or of max_length, in slot 0), the
  largest first, and the LM head at each sequence bucket; with CUDA graphs each is captured after its run
  (graphs.PackedPrefillGraphs), so that a prompt of any length replays a graph.
- A decode step: its batch bucket (1, 2, 4, ... below max_batch, and max_batch) and its sampling mode
  (device_sampling.py's, with feedback as generation runs them; "logits" without, as `LLM.score` runs it). The
  context is device data (positions, lengths): no kernel of the step specialises on it, and the decode attention
  makes its one pick over the whole cache first (`TritonModel.warm_up_step`). The steps are launched, not
  captured: a CUDA graph is captured on its first use in a request (graphs.py: one eager step and the capture,
  which compile and tune nothing once the step has run here).
- The first token's choice from the prefill's logits in each mode, at each row whose parameter views differ in
  alignment (a row's views start at row x 4 or 8 bytes, its penalty rows at row x vocabulary).
- Each slot's reset (its zeroing launch).

Not covered: a one-sequence prefill from a position past 0 (`TritonModel.prefill(start=...)` where the packed
graphs are off: the attention's key adds the context bucket of start + T; with them a chunk runs packed, covered)
and `LLM.score`'s prefill, whose LM head writes the logits of
every position (a GEMM per length bucket over the whole vocabulary: 4 GB of float32 logits at 4096 tokens of the
0.8B, too much to allocate at load).

The warm-up is a flat list of items in a fixed order (`warm_up_items`: each prefill length in each slot, each packed
token bucket, each packed LM head bucket, each first token's choice, each decode batch in each mode), each of which
launches on its own (`Shared` makes what one item needs of another: the prefill's logits, the decode buffers), so
that on a cold Triton cache compile workers can each run a share of them, every item in exactly one share
(`warm_up(share=(index, count))`, engine/compile_workers.py), before this process runs them all.

The warm-up leaves no state behind: its decode steps run on buffers of their own, and it resets every slot at the
end (the KV cache needs no zeroing: no kernel reads past a sequence's length). The model's own progress lines of
a first run ("first prefill: compiling and autotuning ...") are switched off, since no first run compiles any more.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import triton

from ..operators.gated_delta_rule.chunk import SPLIT_PREPARE_TOKENS, chunk_size_for
from ..operators.linear.gemm import MAX_SPLIT_ROWS, TMA_ROWS
from ..progress import progress_printer
from .buffers import DecodeBuffers, PenaltyHistory, bucket
from .device_sampling import PENALIZED_MODES, DeviceSampling, choose_first
from .plan import Plan
from .sampling import SamplingParams

# the decode modes and whether their steps feed back (device_sampling.py), each with parameters that choose it
DECODE_MODES = (
    ("greedy", True, SamplingParams()),
    ("temperature", True, SamplingParams(temperature=1.0)),
    ("min-p", True, SamplingParams(temperature=1.0, min_p=0.05)),
    ("top-k", True, SamplingParams(temperature=1.0, top_k=20, top_p=0.9)),
    ("sample", True, SamplingParams(temperature=1.0, top_p=0.9)),
    ("penalized", True, SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.1,
                                       repetition_penalty=1.1)),
    ("penalized-top-k", True, SamplingParams(temperature=1.0, top_k=20, top_p=0.9, presence_penalty=0.5,
                                             frequency_penalty=0.1, repetition_penalty=1.1)),
    ("penalized-sample", True, SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.5,
                                              frequency_penalty=0.1, repetition_penalty=1.1)),
    ("logits", False, None),  # LLM.score's steps: the logits, no choice
)


def specialization(value: int) -> str:
    """How Triton specialises an integer argument (a kernel compiles once per class)."""
    return "one" if value == 1 else "multiple of 16" if value % 16 == 0 else "other"


def prefill_signature(plan: Plan, tokens: int, row_bytes: int) -> tuple:
    """Everything a prefill of `tokens` tokens from position 0 compiles and tunes on (the module docstring):
    prefills of equal signatures run the same kernels at the same keys and specialisations. row_bytes: a hidden
    row's bytes (the LM head reads the last row: its alignment)."""
    chunk = chunk_size_for(tokens)
    chunks = triton.cdiv(tokens, chunk)
    starts = (plan.gemv_rows + 1, MAX_SPLIT_ROWS + 1, TMA_ROWS, plan.prefill_pdl_tokens + 1, plan.folded_norm_from,
              SPLIT_PREPARE_TOKENS + 1)  # the lengths from which a variant changes
    return (triton.next_power_of_2(tokens), chunk, tuple(tokens >= start for start in starts),
            specialization(tokens), specialization(chunks), (tokens - 1) * row_bytes % 16 == 0)


def prefill_lengths(plan: Plan, max_length: int, row_bytes: int) -> list[int]:
    """One prompt length of each prefill signature up to max_length: the longest of each, by bucket, each bucket's
    longest first."""
    chosen: dict[tuple, int] = {}
    for tokens in range(max_length, 0, -1):
        chosen.setdefault(prefill_signature(plan, tokens, row_bytes), tokens)
    return sorted(chosen.values(), key=lambda tokens: (triton.next_power_of_2(tokens), -tokens))


def decode_batches(max_batch: int) -> list[int]:
    """The decode batch buckets a model of max_batch sequences runs (buffers.bucket: the powers of two below
    max_batch, then max_batch itself)."""
    return sorted({bucket(batch, max_batch) for batch in range(1, max_batch + 1)})


def prefill_slots(state, slots: int) -> list[int]:
    """The slots whose states differ in alignment (a prefill's kernels take one slot's rows of the caches): the
    first of each class; slot 0 alone at every shape the presets have."""
    tensors = [*state.key.values(), *state.value.values(), *state.conv.values(), *state.recurrent.values()]
    chosen: dict[tuple, int] = {}
    for slot in range(slots):
        chosen.setdefault(tuple(t[slot].data_ptr() % 16 == 0 for t in tensors), slot)
    return sorted(chosen.values())


def first_token_rows(rows: int, vocab: int) -> list[int]:
    """The rows below `rows` whose sampling parameter views differ in alignment: the first of each class (the
    4- and 8-byte parameters at row x 4 or 8 bytes, the penalties' counts and prompt mask at row x vocab x 4 and
    row x vocab bytes)."""
    chosen: dict[tuple, int] = {}
    for row in range(rows):
        chosen.setdefault(tuple(row * size % 16 == 0 for size in (4, 8, 4 * vocab, vocab)), row)
    return sorted(chosen.values())


def _load_sampling(buffers: DecodeBuffers, sampling: DeviceSampling | None, history: PenaltyHistory) -> None:
    """Inputs at position 0 and every row's sampling parameters, as decode_tokens loads them."""
    size = buffers.size
    buffers.load(torch.zeros(size, dtype=torch.int64, device=buffers.token_ids.device),
                 torch.zeros(size, dtype=torch.int32, device=buffers.positions.device))
    buffers.step.zero_()
    if sampling is None:
        return
    for name in ("temperature", "top_k", "top_p", "seed", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty"):
        getattr(buffers, name).copy_(getattr(sampling, name)[:size])
    if sampling.mode in PENALIZED_MODES:  # the rows' slots' histories (the model's), zeroed again at the end
        counts, prompt_mask = history.tensors()
        counts.zero_()
        prompt_mask.zero_()


@dataclass(frozen=True)
class Contents:
    """What a warm-up of a model runs: its prefill lengths and slots, its packed passes' token buckets and their
    LM head's sequence buckets, its decode batches and the rows of the first token's choices."""

    prefill_lengths: tuple[int, ...]
    prefill_slots: tuple[int, ...]
    packed_tokens: tuple[int, ...]  # the largest first
    packed_rows: tuple[int, ...]
    batches: tuple[int, ...]
    first_token_rows: tuple[int, ...]

    @classmethod
    def of(cls, model) -> "Contents":
        row_bytes = model.config.hidden_size * model.embed.element_size()
        batches = decode_batches(model.max_batch)
        packed = model.plan.packed_prefill
        return cls(tuple(prefill_lengths(model.plan, model.max_length, row_bytes)),
                   tuple(prefill_slots(model.state, model.max_batch)),
                   tuple(sorted(model.packed_buckets, reverse=True)) if packed else (),
                   tuple(model.packed_head_buckets) if packed else (), tuple(batches),
                   tuple(first_token_rows(batches[-1], model.config.vocab_size)))


@dataclass(frozen=True)
class Item:
    """One piece of the warm-up, launched by run(): a prefill of one length in one slot, a packed pass of one token
    bucket, the packed LM head at one sequence bucket, the first token's choice in one mode at one row, or a decode
    step of one batch in one mode. The pieces are independent (`Shared` makes what one needs of another's: the
    logits, the buffers), so that compile workers can each run a share of them (engine/compile_workers.py).
    group: the piece's place in its phase's progress line (its length bucket, its token bucket, its batch)."""

    phase: str  # "prefill", "packed prefill", "packed head", "first token" or "decode"
    name: str
    group: int
    run: Callable[[], None] = field(compare=False, repr=False)


class Shared:
    """What the items of one warm-up share, each made when an item first needs it: the last prefill's logits (the
    first token's choices read them), each mode's sampling parameters, the first token's penalty history (its own:
    the model's stays as it was) and the decode buffers of the batch being run (their own too)."""

    def __init__(self, model, contents: Contents):
        self.model, self.contents = model, contents
        self.logits: torch.Tensor | None = None
        self._samplings: dict[str, DeviceSampling] | None = None
        self._history: PenaltyHistory | None = None
        self._buffers: DecodeBuffers | None = None
        self._prompt = torch.zeros(1, dtype=torch.int64, device=model.device)

    def prefill(self, tokens: int, slot: int) -> None:
        model = self.model
        model.reset(slot)
        ids = torch.zeros(tokens, dtype=torch.int64, device=model.device)
        self.logits = model.prefill_eager(ids, slot, 0, False)

    def packed_prefill(self, tokens: int) -> None:
        model = self.model
        model.reset(0)
        model.prefill_packed([torch.zeros(min(tokens, model.max_length), dtype=torch.int64)], [0], [0])

    @property
    def samplings(self) -> dict[str, DeviceSampling]:
        """Each mode's parameters for every row of the largest batch."""
        if self._samplings is None:
            rows, device = self.contents.batches[-1], self.model.device
            self._samplings = {mode: DeviceSampling.build([params] * rows, device)
                               for mode, _, params in DECODE_MODES if params is not None}
            for mode, sampling in self._samplings.items():
                if sampling.mode != mode:
                    raise AssertionError(f"the warm-up's parameters for mode {mode!r} choose {sampling.mode!r}")
        return self._samplings

    def choose_first(self, mode: str, row: int) -> None:
        """The first token's choice at `row` from the last prefill's logits; in a share that ran no prefill, from
        zeros of their shape and dtype (what the choice's kernels specialise on)."""
        model, sampling = self.model, self.samplings[mode]
        if self.logits is None:
            self.logits = torch.zeros(1, model.config.vocab_size, dtype=torch.float32, device=model.device)
        if sampling.mode not in PENALIZED_MODES:
            choose_first(self.logits, sampling, row)
            return
        if self._history is None:
            self._history = PenaltyHistory(self.contents.batches[-1], model.config.vocab_size, model.device)
        counts, prompt_mask = self._history.start(row, self._prompt)
        choose_first(self.logits, sampling, row, counts, prompt_mask)

    def decode(self, size: int, mode: str, feedback: bool) -> None:
        model = self.model
        self._history = None  # the first token's choices are done
        if self._buffers is None or self._buffers.size != size:
            self._buffers = None  # the last batch's, freed before this one's are made
            self._buffers = DecodeBuffers(model.config, size, model.device, model.dtype)
        _load_sampling(self._buffers, self.samplings.get(mode), model.history)
        model.warm_up_step(self._buffers, mode, feedback)

    def close(self) -> None:
        self._history = self._buffers = None


def warm_up_items(model, contents: Contents | None = None) -> tuple[list[Item], Shared]:
    """The warm-up as a flat list, in the order `warm_up` runs it (each length bucket's prefills, the packed passes
    from the largest bucket, the packed LM heads, the first token's choices, the decode steps by batch), and the
    state its items share. The list depends only on the model's config, plan, dtype, max_length and max_batch, so a
    compile worker's model of the same makes the same list."""
    contents = Contents.of(model) if contents is None else contents
    shared = Shared(model, contents)
    items: list[Item] = []
    buckets = sorted({triton.next_power_of_2(tokens) for tokens in contents.prefill_lengths})
    for group, length_bucket in enumerate(buckets):
        for tokens in (t for t in contents.prefill_lengths if triton.next_power_of_2(t) == length_bucket):
            for slot in contents.prefill_slots:
                items.append(Item("prefill", f"prefill of {tokens} tokens in slot {slot}", group,
                                  partial(shared.prefill, tokens, slot)))
    for group, tokens in enumerate(contents.packed_tokens):
        items.append(Item("packed prefill", f"packed prefill of {tokens} tokens", group,
                          partial(shared.packed_prefill, tokens)))
    for group, rows in enumerate(contents.packed_rows):
        items.append(Item("packed head", f"packed LM head of {rows} rows", group,
                          partial(model.warm_up_packed_head, rows)))
    for mode, _, params in DECODE_MODES:
        for row in contents.first_token_rows if params is not None else ():
            items.append(Item("first token", f"first token's choice, {mode}, row {row}", 0,
                              partial(shared.choose_first, mode, row)))
    for group, size in enumerate(contents.batches):
        for mode, feedback, _ in DECODE_MODES:
            items.append(Item("decode", f"decode step of batch {size}, {mode}", group,
                              partial(shared.decode, size, mode, feedback)))
    return items, shared


def share_of(items: list, share: tuple[int, int] | None) -> list:
    """The items of share (index, count): those at positions index, index + count, ...; share None: all."""
    if share is None:
        return list(items)
    index, count = share
    if not 0 <= index < count:
        raise ValueError(f"share must be (index, count) with 0 <= index < count, got {share}")
    return items[index::count]


def _progress_reports(model, items: list[Item]) -> dict[int, Callable[[], None]]:
    """position in `items` -> the progress line's update after that item: the last item of each group of the
    prefills (by length bucket), the packed passes and the decode steps (by batch)."""
    labels = {"prefill": "warm-up: prefill buckets",
              "packed prefill": "warm-up: packed prefill buckets" + (" (CUDA graphs)" if model.packed_graphs else ""),
              "decode": "warm-up: decode batches"}
    reports = {}
    for phase, label in labels.items():
        ends = {item.group: position for position, item in enumerate(items) if item.phase == phase}
        report = progress_printer(label)
        for done, position in enumerate(sorted(ends.values()), 1):
            reports[position] = partial(report, done, len(ends))
    return reports


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up ran and how long it took (a share of it: the whole warm-up's contents, `share` its part)."""

    prefill_lengths: tuple[int, ...]
    prefill_slots: tuple[int, ...]
    packed_tokens: tuple[int, ...]  # the packed passes' token buckets
    packed_rows: tuple[int, ...]  # their LM head's sequence buckets
    batches: tuple[int, ...]
    modes: tuple[str, ...]
    first_token_rows: tuple[int, ...]
    seconds: float
    share: tuple[int, int] | None = None  # (index, count): the items this run ran (`share_of`); None: all
    compile_workers: int = 0  # the compile workers that ran before it (engine/compile_workers.py)
    compile_seconds: float = 0.0  # their time, counted in seconds

    def summary(self) -> str:
        lengths = self.prefill_lengths
        buckets = sorted({triton.next_power_of_2(tokens) for tokens in lengths})
        packed_buckets = (f", {len(self.packed_tokens)} packed prefill buckets ({min(self.packed_tokens)} to "
                          f"{max(self.packed_tokens)} tokens)" if self.packed_tokens else "")
        part = "" if self.share is None else f" (share {self.share[0] + 1} of {self.share[1]})"
        workers = (f" ({self.compile_workers} compile workers first: {self.compile_seconds:.1f} s of it)"
                   if self.compile_workers else "")
        return (f"warm-up{part}: {len(lengths)} prefill lengths ({len(buckets)} buckets, {lengths[0]} to "
                f"{max(lengths)} tokens){packed_buckets}, decode at batch {', '.join(map(str, self.batches))} in "
                f"{len(self.modes)} modes: {self.seconds:.1f} s{workers}")


@torch.no_grad()
def warm_up(model, progress: bool = False, share: tuple[int, int] | None = None,
            compiled: tuple[int, float] = (0, 0.0)) -> WarmUp:
    """Run every prefill length of `prefill_lengths`, the packed passes, the first token's choice and every decode
    step of `decode_batches` x DECODE_MODES on `model` (a TritonModel), then reset every slot. progress: a line per
    phase on stderr and the summary. share (index, count): only the items `share_of` gives that share (a compile
    worker's part, engine/compile_workers.py); None: all of them. compiled: the count and time of the compile
    workers that ran before this warm-up, for its report."""
    started = time.perf_counter()
    model.progress = False  # its first-run lines (they would say compiling): the warm-up's own instead
    contents = Contents.of(model)
    items, shared = warm_up_items(model, contents)
    items = share_of(items, share)
    reports = _progress_reports(model, items) if progress else {}
    for position, item in enumerate(items):
        item.run()
        if position in reports:
            reports[position]()
    shared.close()
    model.reset()
    if model.history.counts is not None:  # the penalized steps' counts: no history left behind
        model.history.counts.zero_()
        model.history.prompt_mask.zero_()
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    done = WarmUp(contents.prefill_lengths, contents.prefill_slots, contents.packed_tokens, contents.packed_rows,
                  contents.batches, tuple(mode for mode, _, _ in DECODE_MODES), contents.first_token_rows,
                  time.perf_counter() - started + compiled[1], share, *compiled)
    if progress:
        print(done.summary(), file=sys.stderr, flush=True)
    return done


__all__ = ["DECODE_MODES", "Contents", "Item", "Shared", "WarmUp", "decode_batches", "first_token_rows",
           "prefill_lengths", "prefill_signature", "prefill_slots", "share_of", "specialization", "warm_up",
           "warm_up_items"]
