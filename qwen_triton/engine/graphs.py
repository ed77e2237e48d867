"""The CUDA-graph manager of the Triton backend: decode steps by batch bucket, packed prefills by token bucket, and
repeated one-sequence prefills.

Decode: each (bucket, mode, feedback) step is captured once after a warm-up outside the graph (compilation,
autotuning, workspaces) and replayed: inputs are copied into static buffers (the rows' slots too: a graph serves
any slot set), nothing is allocated and nothing waits on the host. The warm-up runs the step for real, so the
states it advances (those of its rows' slots) are restored before capture.

Packed prefill (engine/packed.py): the layers of a pass over a token bucket's rows are one graph per bucket, and
the final norm and LM head of its sequences' last rows one graph per sequence bucket; both read what a pass is (its
ids, positions, slots, layout and last rows) from one static int32 buffer that the host fills before each replay,
and the layers leave each sequence's last row in a static buffer that the head reads, so a bucket's graphs serve
any prompts, lengths, starts and slots that fit it. A bucket's first pass runs eagerly (it is this call's pass, and
the kernels' first run: compilation and autotuning, done by the warm-up at load) and is captured after it; every
later pass replays. The graphs share one memory pool (they never run at once); the warm-up captures the largest
bucket first.

One-sequence prefill (the logits of every position, `LLM.score`'s; every prefill where the packed graphs are
off): a prefill from position 0 that repeats an earlier (length, slot, all_logits) is captured on its second
call and replayed from then on: the ~180 launches of a prefill cost the host far more than the GPU work at short
lengths. A length seen once runs eagerly (no capture cost for one-off prompts); the most recent `keep` graphs are
kept, sharing one memory pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import packed


def _advanced(states, history) -> list[torch.Tensor]:
    """The [slot, ...] tensors a decode step advances: every conv and recurrent state (ModelState) and the
    penalties' token counts (PenaltyHistory), once allocated."""
    tensors = list(states.conv.values()) + list(states.recurrent.values())
    if history is not None and history.counts is not None:
        tensors.append(history.counts)
    return tensors


def save_states(states, history, slots: torch.Tensor):
    """Copies of what a step on rows' slots `slots` (int32 [bucket], a padding row's negative) advances, gathered
    on the device: the step's own slots, a padding row's read as slot 0's (saved and restored unchanged)."""
    index = slots.clamp(min=0).long()
    return index, [t.index_select(0, index) for t in _advanced(states, history)]


def restore_states(states, history, saved) -> None:
    index, copies = saved
    for t, copy in zip(_advanced(states, history), copies):
        t.index_copy_(0, index, copy)  # a repeated slot's copies are equal


class DecodeGraphs:
    def __init__(self, device: torch.device, states, history=None):
        self.device = device
        self.states = states  # ModelState: the conv and recurrent states a warm-up advances
        self.history = history  # PenaltyHistory: the token counts a penalized warm-up advances
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}

    def run(self, key: tuple, buffers, step: Callable[[], None], warm_up: Callable[[Callable], None]) -> None:
        """Replay the graph of `key`, capturing it first: warm_up(step) runs the step once on a side stream."""
        graph = self.graphs.get(key)
        if graph is None:
            saved = save_states(self.states, self.history, buffers.slots)
            inputs = [t.clone() for t in buffers.inputs]
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                warm_up(step)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            restore_states(self.states, self.history, saved)
            for buffer, value in zip(buffers.inputs, inputs):
                buffer.copy_(value)
            self.graphs[key] = graph
        graph.replay()


class PrefillGraphs:
    def __init__(self, keep: int):
        self.keep = keep
        self.graphs: dict[tuple, tuple] = {}  # (tokens, slot, all_logits) -> (graph, ids, logits)
        self.seen: dict[tuple, int] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def run(self, token_ids: torch.Tensor, slot: int, all_logits: bool,
            prefill: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """prefill(token_ids) -> logits, eagerly on a length's first call, captured on its second, replayed after."""
        key = (token_ids.shape[0], slot, all_logits)
        entry = self.graphs.get(key)
        if entry is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] < 2:
                return prefill(token_ids)  # also the warm-up of this shape
            if len(self.graphs) >= self.keep:
                self.graphs.pop(next(iter(self.graphs)))
            static_ids = token_ids.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = prefill(static_ids)
            entry = self.graphs[key] = (graph, static_ids, logits)
        graph, static_ids, logits = entry
        static_ids.copy_(token_ids)
        graph.replay()
        return logits.clone()


class PackedPrefillGraphs:
    def __init__(self, device: torch.device, largest_tokens: int, head_rows: int, hidden_size: int,
                 dtype: torch.dtype):
        self.device = device
        self.rows = head_rows  # the static last rows' entries: the largest sequence bucket
        self.inputs = torch.zeros(packed.input_size(largest_tokens, head_rows), device=device, dtype=torch.int32)
        self.hidden = torch.zeros(head_rows, hidden_size, device=device, dtype=dtype)
        self.bodies: dict[int, torch.cuda.CUDAGraph] = {}  # token bucket -> the layers' graph
        self.heads: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # sequence bucket -> (graph, logits)
        self.pool = torch.cuda.graph_pool_handle()

    def load(self, token_ids, slots, starts, tokens: int) -> packed.PackedInputs:
        """The pass's inputs copied into the static buffer (one copy from pinned memory, then the ids of prompts
        given on the device); its views of bucket `tokens`."""
        host, layout = packed.pack_inputs(token_ids, starts, slots, tokens, self.rows)
        self.inputs[:host.numel()].copy_(host.pin_memory(), non_blocking=True)
        inputs = packed.PackedInputs.view(self.inputs, tokens, self.rows, layout)
        packed.copy_device_prompts(inputs, token_ids, layout)
        return inputs

    def _capture(self, launch: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            result = launch()
        return graph, result

    def run(self, token_ids, slots, starts, tokens: int, body: Callable, head: Callable) -> torch.Tensor:
        """Logits [S, vocab] of a pass of the prompts over `tokens` rows: body(inputs, hidden) launches its layers
        and gathers its last rows, head(hidden rows) its LM head; each replayed from its bucket's graph, or run
        eagerly and then captured on a bucket's first pass."""
        inputs = self.load(token_ids, slots, starts, tokens)
        graph = self.bodies.get(tokens)
        if graph is None:
            body(inputs, self.hidden)
            self.bodies[tokens], _ = self._capture(lambda: body(inputs, self.hidden))
        else:
            graph.replay()
        return self.head(packed.head_rows(len(token_ids)), head)[:len(token_ids)].clone()

    def head(self, rows: int, head: Callable) -> torch.Tensor:
        """The LM head of the static last rows' first `rows`: replayed, or run eagerly and then captured on a
        sequence bucket's first use (its logits then this run's)."""
        entry = self.heads.get(rows)
        if entry is None:
            logits = head(self.hidden[:rows])
            self.heads[rows] = self._capture(lambda: head(self.hidden[:rows]))
            return logits
        graph, logits = entry
        graph.replay()
        return logits
