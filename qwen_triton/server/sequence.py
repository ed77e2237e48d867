"""One sequence of the server: a prompt to continue with its sampling parameters and limits, the state the
engine thread keeps for it while it runs, and what each step sends back for it.

A request makes one sequence per prompt and choice (`n`). The HTTP side builds the Sequence and hands it to
the scheduler; from then on only the engine thread writes its fields, except `aborted`, which the HTTP side
sets (a flag read between steps). `receiver` is the HTTP side's own handle (its queue); the scheduler only
passes it back with each output.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from ..engine.sampling import SamplingParams

_identities = itertools.count()

WAITING, PREFILLING, DECODING, FINISHED = "waiting", "prefilling", "decoding", "finished"


@dataclass
class SequenceOutput:
    """What one step produced for one sequence: the id it chose (with its log-probability and the most likely
    ids' when asked for), and, on the sequence's last output, why it ended; or an error, with no id."""

    token_id: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (id, log-probability), the likeliest first
    finish_reason: str | None = None  # "stop" (a stop or end-of-turn id) or "length" (max_tokens)
    error: str | None = None


@dataclass(eq=False)
class Sequence:
    """A prompt to continue. stop_token_ids end it (the end-of-turn ids among them unless the request ignores
    them); max_tokens bounds its generated ids, the one that ends it included; logprobs: None for none, else how
    many of the likeliest ids to report beside the chosen one's (0 to 20)."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None
    index: int = 0  # the choice's index in its response
    receiver: object = None
    # ---- the engine thread's --------------------------------------------------------------------
    identity: int = field(default_factory=lambda: next(_identities))
    state: str = WAITING
    slot: int | None = None
    prefilled: int = 0  # prompt tokens already in the slot's caches
    budget: int = 0  # the most ids it may generate: max_tokens, or less where the context ends first
    generated: list[int] = field(default_factory=list)
    sampling_state: object = None  # the sampler's (a generator, penalty counts)
    arrival_time: float = field(default_factory=time.perf_counter)
    admitted_time: float | None = None  # when it was given a slot
    last_token_time: float | None = None
    # ---- set by the HTTP side ---------------------------------------------------------------------
    aborted: bool = False

    @property
    def position(self) -> int:
        """The position of the next decode step's input: the last generated id."""
        return len(self.prompt_ids) + len(self.generated) - 1
