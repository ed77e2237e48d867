"""Generation ahead of the host, several steps per CUDA-graph replay: the GPU never waits for Python
between decode steps, and the cost around a replay is paid once per group of steps.

A decode step chooses its ids on the device and, with feedback (operators/sampling/feedback.py), writes
them back as the next step's inputs. So step k+1 can be launched before the host has read step k's ids:
the host launches k+1, then waits for k's ids, runs its stop checks and the detokenizer while k+1 runs, and
launches k+2. The time per token is then the GPU's time per step, not the GPU's time plus the host's.
The feedback kernel itself writes each step's ids into pinned host memory: the host waits on an event
recorded after the step, and nothing but the steps runs on the GPU's stream.

Groups. Each launch runs `steps_per_replay` (n, default STEPS_PER_REPLAY) consecutive steps, one call of
TritonModel.decode_tokens(group=n) and one replay of a graph that holds all n, so the graph's boundary
and what the pipeline adds around a replay (its event, the host's wait for the ids) come once per n
steps: with one step a replay they cost about 17 and 10 us a step on the H200 (benchmarks/step_gap.py;
docs/perf-notes.md, "The time outside the step's graph"). One group is kept in flight ahead of the host:
when the host asks for the first id of group G, group G+1 is launched, then the host waits for G and
hands its n ids back one `step()` at a time (the other n - 1 calls wait for nothing). The feedback kernel
writes a row's id of a step into host row (its draw counter) % 2n, so G's ids land in distinct rows and
G+1 writes the other n while the host reads G's. A group is launched only while every running row's last
step of it fits in the cache (its position < max_length); nearer the end of the cache the launches are
single steps (their own ring of two rows), and when not even one more fits, nothing is launched ahead.
n = 1 is the one-step pipeline exactly.

The price: steps computed past the end of a generation, their results dropped: with groups of n, n to
2n - 1 of them (the rest of the last id's group and the group in flight; one with n = 1); and for rows of
a batch that stop before the others, steps whose results are unused. The results themselves are identical
to running one step at a time: the same kernels on the same inputs, and the same draws (the draw counter
that seeds sampling is fed back with the ids). Without `ahead` (the default off a GPU) every step is
launched alone from the host's inputs and read at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

STEPS_PER_REPLAY = 4  # decode steps in one launch (one CUDA-graph replay) while the cache has room for them


@dataclass
class _Launch:
    """One call of decode_tokens with feedback whose ids have not all been handed back."""

    count: int  # consecutive steps it runs
    steps: list[int]  # each row's draw counter at its first step (where its ids land in the ring)
    ring: torch.Tensor  # the host ring its ids land in: int64 [2 * count, bucket]
    event: torch.cuda.Event | None  # recorded after it (None off a GPU, where the launch has finished)
    ids: list[list[int]] | None = None  # per step, each row's id, once read
    handed: int = 0  # steps whose ids step() has returned


class DecodePipeline:
    """Launches decode steps of the rows in slots 0..B-1 and hands back their chosen ids one step at a time,
    in order. With `ahead` (the default on a GPU) the steps are launched `steps_per_replay` at a time, one
    launch kept in flight ahead of the host."""

    def __init__(self, model, sampling, ahead: bool | None = None, steps_per_replay: int = STEPS_PER_REPLAY):
        if not isinstance(steps_per_replay, int) or steps_per_replay < 1:
            raise ValueError(f"steps_per_replay must be a positive int, got {steps_per_replay!r}")
        self.model = model
        self.sampling = sampling
        self.rows = sampling.temperature.shape[0]
        self.ahead = model.device.type == "cuda" if ahead is None else ahead
        self.steps_per_replay = steps_per_replay
        # the host rings of single steps and of groups (allocated now: before any graph that writes them)
        self._rings = {count: model.chosen_on_host(self.rows, count) for count in {1, steps_per_replay}}
        # one event per launch not yet read (the one being read and the one in flight)
        self._events = [torch.cuda.Event() if model.device.type == "cuda" else None for _ in range(2)]
        self._launched = 0
        self._queue: deque[_Launch] = deque()  # launches with ids still to hand back, oldest first
        self._previous = None  # (ids, positions, steps) of the step handed back last

    def _count(self, positions: list[int], running: list[bool], offset: int) -> int:
        """Steps the next launch runs, its first step at `positions` + `offset`: a group when every running
        row's last step of it is inside the cache, else one step when that fits, else none."""
        last = max((positions[row] + offset for row in range(self.rows) if running[row]), default=offset)
        for count in (self.steps_per_replay, 1):
            if last + count - 1 < self.model.max_length:
                return count
        return 0

    def _launch(self, count: int, steps: list[int], token_ids=None, positions=None, step_tensor=None) -> None:
        """Launch `count` steps whose rows have drawn `steps` tokens before the first (None inputs: continue
        from the ids the last launch fed back)."""
        self.model.decode_tokens(token_ids, positions, self.sampling, step_tensor, feedback=True, group=count)
        event = self._events[self._launched % 2]
        if event is not None:
            event.record()
        self._queue.append(_Launch(count, steps, self._rings[count], event))
        self._launched += 1

    def _read(self, launch: _Launch) -> None:
        """Wait for `launch` and take its ids from its ring: row r's id of its k-th step in ring row
        (r's draw counter at the first step + k) % (2 * count), where the feedback kernel wrote it."""
        if launch.event is not None:
            launch.event.synchronize()
        table = launch.ring.tolist()
        ring = len(table)
        launch.ids = [[table[(launch.steps[row] + offset) % ring][row] for row in range(self.rows)]
                      for offset in range(launch.count)]

    def _check_continuation(self, inputs: list[int], positions: list[int], steps: list[int],
                            running: list[bool]) -> None:
        """The host's inputs must be what the launched step runs on: the previous step's ids, at the next
        position, with the next draw."""
        ids, last_positions, last_steps = self._previous
        for row in range(self.rows):
            if running[row] and (inputs[row], positions[row], steps[row]) != (
                    ids[row], last_positions[row] + 1, last_steps[row] + 1):
                raise RuntimeError(
                    f"decode pipeline: row {row} continues from id {inputs[row]} at position {positions[row]}, "
                    f"but the step launched ahead ran on id {ids[row]} at position {last_positions[row] + 1}"
                )

    def step(self, inputs: list[int], positions: list[int], steps: list[int], running: list[bool]) -> list[int]:
        """The ids chosen after feeding `inputs` at `positions` (one per row; `steps` counts each row's
        generated tokens). Rows not `running` have stopped: their inputs are ignored, their ids unused."""
        if self._queue:
            self._check_continuation(inputs, positions, steps, running)
        else:
            device = self.model.device
            count = max(self._count(positions, running, 0), 1) if self.ahead else 1
            self._launch(count, list(steps), torch.tensor(inputs, device=device),
                         torch.tensor(positions, device=device), torch.tensor(steps, device=device))
        launch = self._queue[0]
        if launch.ids is None:
            # before waiting for this launch, the next one: it continues from the fed-back inputs
            count = self._count(positions, running, launch.count) if self.ahead else 0
            if count:
                self._launch(count, [step + launch.count for step in launch.steps])
            self._read(launch)
        ids = launch.ids[launch.handed]
        launch.handed += 1
        if launch.handed == launch.count:
            self._queue.popleft()
        self._previous = (ids, list(positions), list(steps))
        return ids
