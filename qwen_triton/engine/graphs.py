"""The CUDA-graph manager of the Triton backend: decode steps by batch bucket, and repeated prefills.

Decode: each (bucket, mode, feedback) step is captured once after a warm-up outside the graph (compilation,
autotuning, workspaces) and replayed: inputs are copied into static buffers (the rows' slots too: a graph serves
any slot set), nothing is allocated and nothing waits on the host. The warm-up runs the step for real, so the
states it advances (those of its rows' slots) are restored before capture.

Prefill: a prefill from position 0 that repeats an earlier (length, slot, all_logits) is captured on its second
call and replayed from then on: the ~180 launches of a prefill cost the host far more than the GPU work at short
lengths. A length seen once runs eagerly (no capture cost for one-off prompts); the most recent `keep` graphs are
kept, sharing one memory pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
