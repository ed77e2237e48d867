"""Generation one step ahead of the host: the GPU never waits for Python between decode steps.

A decode step chooses its ids on the device and, with feedback (operators/sampling/feedback.py), writes
them back as the next step's inputs. So step k+1 can be launched before the host has read step k's ids:
the host launches k+1, then waits for k's ids, runs its stop checks and the detokenizer while k+1 runs, and
launches k+2. The time per token is then the GPU's time per step, not the GPU's time plus the host's.
The feedback kernel itself writes each step's ids into pinned host memory (a row per step parity, so step
k+1 writes the other row while the host reads step k's): the host waits on an event recorded after the
step, and nothing but the steps runs on the GPU's stream.

The price is one step computed past the end of a generation (its result is dropped) and, for rows of a
batch that stop before the others, steps whose results are unused; the results themselves are identical
to running one step at a time (same kernels, same inputs). A step is launched ahead only while every
running row's next position fits in the cache.

Several steps per CUDA-graph replay, their ids read a group at a time, gain too little (docs/decisions.md,
D102): 738.8 against 743.4 us a token at context 128 for groups of 4, against the steps a group computes past a
stop and the later detection of it.
"""

from __future__ import annotations

import torch


class DecodePipeline:
    """Launches decode steps of the rows in slots 0..B-1 and hands back their chosen ids in order, keeping
    one step in flight when `ahead` is set (the default on a GPU)."""

    def __init__(self, model, sampling, ahead: bool | None = None):
        self.model = model
        self.sampling = sampling
        self.rows = sampling.temperature.shape[0]
        self.ahead = model.device.type == "cuda" if ahead is None else ahead
        self._host = model.chosen_on_host(self.rows)  # [2, bucket]: row steps % 2 holds a step's ids
        # one event per step in flight (the one being read and the one running), and each one's step counters
        self._events = [torch.cuda.Event() if model.device.type == "cuda" else None for _ in range(2)]
        self._steps: list[list[int] | None] = [None, None]
        self._launched = 0
        self._pending: int | None = None  # the step launched ahead of the host, not yet read
        self._expected = None  # (ids, positions, steps) the pending step ran on

    def _launch(self, steps: list[int], token_ids=None, positions=None, step_tensor=None) -> int:
        """Launch one step whose rows have drawn `steps` tokens so far (its ids land in host row steps % 2)."""
        self.model.decode_tokens(token_ids, positions, self.sampling, step_tensor, feedback=True)
        index = self._launched % 2
        if self._events[index] is not None:
            self._events[index].record()
        self._steps[index] = steps
        self._launched += 1
        return index

    def _read(self, index: int) -> list[int]:
        if self._events[index] is not None:
            self._events[index].synchronize()
        rows = self._host.tolist()
        return [rows[step % 2][row] for row, step in enumerate(self._steps[index])]

    def step(self, inputs: list[int], positions: list[int], steps: list[int], running: list[bool]) -> list[int]:
        """The ids chosen after feeding `inputs` at `positions` (one per row; `steps` counts each row's
        generated tokens). Rows not `running` have stopped: their inputs are ignored, their ids unused."""
        if self._pending is not None:
            index = self._pending
            ids, last_positions, last_steps = self._expected
            for row in range(self.rows):
                if running[row] and (inputs[row], positions[row], steps[row]) != (
                        ids[row], last_positions[row] + 1, last_steps[row] + 1):
                    raise RuntimeError(
                        f"decode pipeline: row {row} continues from id {inputs[row]} at position {positions[row]}, "
                        f"but the step launched ahead ran on id {ids[row]} at position {last_positions[row] + 1}"
                    )
        else:
            device = self.model.device
            index = self._launch(list(steps), torch.tensor(inputs, device=device),
                                 torch.tensor(positions, device=device), torch.tensor(steps, device=device))
        self._pending = None
        if self.ahead and all(positions[row] + 1 < self.model.max_length for row in range(self.rows) if running[row]):
            self._pending = self._launch([step + 1 for step in steps])  # continues from the fed-back inputs
        ids = self._read(index)
        self._expected = (ids, list(positions), list(steps))  # copies: the caller may reuse its lists
        return ids
