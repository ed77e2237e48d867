"""The engine loop on its own (no HTTP): slots given, reset and freed with the sequences, batched decodes over
whichever slots the running sequences hold, prompts prefilled in chunks at fixed boundaries, an abort that frees
its slot within a step, the queue's limit, a failing step that fails only its sequences, and stop."""

import threading
import time
from collections import defaultdict

import pytest
import torch

from qwen_triton.engine.sampling import SamplingParams
from qwen_triton.server.scheduler import STOPPING, QueueFull, Scheduler, ShuttingDown
from qwen_triton.server.sequence import Sequence
from tests.server.conftest import load


class RecordingBackend:
    """The reference backend, recording the slots of each decode, the (slot, start, length) of each prompt chunk
    prefilled (and, by prefill_batch call, `batches` of them) and each reset; `fail_next_decode` makes the next
    decode raise, `poison_slot` makes that slot's logits NaN."""

    def __init__(self, backend):
        self.backend = backend
        self.decodes: list[list[int]] = []
        self.prefills: list[tuple[int, int, int]] = []
        self.batches: list[list[tuple[int, int, int]]] = []
        self.resets: list[int] = []
        self.fail_next_decode = False
        self.poison_slot: int | None = None

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def decode(self, token_ids, positions, slots=None):
        self.decodes.append(slots.tolist())
        if self.fail_next_decode:
            self.fail_next_decode = False
            raise RuntimeError("a simulated device failure")
        logits = self.backend.decode(token_ids, positions, slots=slots)
        if self.poison_slot is not None and self.poison_slot in self.decodes[-1]:
            logits[self.decodes[-1].index(self.poison_slot)] = float("nan")
        return logits

    def prefill_batch(self, token_ids, slots, starts=None):
        self.batches.append([(slot, start, ids.shape[0]) for ids, slot, start in zip(token_ids, slots, starts)])
        self.prefills += self.batches[-1]
        return self.backend.prefill_batch(token_ids, slots, starts)

    def reset(self, slot=None):
        self.resets.append(slot)
        self.backend.reset(slot)


class Collector:
    """The scheduler's emit: every output by sequence."""

    def __init__(self):
        self.outputs = defaultdict(list)
        self.lock = threading.Lock()

    def __call__(self, outputs):
        with self.lock:
            for sequence, output in outputs:
                self.outputs[sequence.identity].append(output)

    def tokens(self, sequence):
        return [o.token_id for o in self.outputs[sequence.identity]]

    def wait_for(self, sequence, count, timeout=30.0):
        deadline = time.monotonic() + timeout
        while len(self.outputs[sequence.identity]) < count:
            assert time.monotonic() < deadline, "the sequence produced too little"
            time.sleep(0.005)


@pytest.fixture
def engine(checkpoint):
    """A scheduler of 2 slots, 4 waiting, prompts prefilled 16 tokens a step, over a recording backend."""
    llm = load(checkpoint, max_batch=2)
    backend = RecordingBackend(llm.model)
    collector = Collector()
    scheduler = Scheduler(backend, max_num_seqs=2, max_queue=4, prefill_chunk=16, emit=collector)
    scheduler.start()
    yield scheduler, backend, collector
    scheduler.stop()


def sequence(prompt, max_tokens, **params):
    return Sequence(list(prompt), SamplingParams(**params), max_tokens)


def test_slots_are_given_reset_and_freed_and_each_sequence_equals_generate(engine, oracle):
    scheduler, backend, collector = engine
    prompts = [[3 + i, 50 + i, 700 + i] for i in range(6)]
    sequences = [sequence(p, 4) for p in prompts[:3]] + [sequence(p, 4, temperature=1.0, seed=i)
                                                        for i, p in enumerate(prompts[3:])]
    scheduler.submit(sequences)
    assert scheduler.wait_until_idle(60)
    expected = [oracle.generate(p, max_new_tokens=4).token_ids for p in prompts[:3]]
    expected += [oracle.generate(p, max_new_tokens=4, temperature=1.0, seed=i).token_ids
                 for i, p in enumerate(prompts[3:])]
    assert [collector.tokens(s) for s in sequences] == expected
    assert [collector.outputs[s.identity][-1].finish_reason for s in sequences] == ["length"] * 6
    assert sorted(backend.resets) == [0, 0, 0, 1, 1, 1]  # every slot reset each time it is given
    assert all(len(set(slots)) == len(slots) and set(slots) <= {0, 1} for slots in backend.decodes)
    assert max(len(slots) for slots in backend.decodes) == 2
    assert sorted(scheduler.free_slots) == [0, 1] and scheduler.running == 0
    assert scheduler.statistics.finished == 6
    # each first token's time in two parts: waiting for a slot (four of them wait for the first two to end), then
    # the slot to the first id
    metrics = scheduler.metrics
    (queue_counts, queue_sum), (prefill_counts, prefill_sum) = metrics.queue_time.state(), metrics.prefill_time.state()
    first_counts, first_sum = metrics.time_to_first_token.state()
    assert sum(queue_counts) == sum(prefill_counts) == sum(first_counts) == 6
    assert queue_sum + prefill_sum == pytest.approx(first_sum, rel=1e-9) and queue_sum > 0 and prefill_sum > 0


def test_prompts_are_prefilled_in_chunks_at_fixed_boundaries(engine, oracle):
    scheduler, backend, collector = engine
    long_prompt = [(5 * i + 1) % 3000 + 10 for i in range(37)]
    short = [sequence([11, 12, 13, 14, 15, 16, 17, 18, 19, 20], 2), sequence([21, 22, 23, 24, 25, 26, 27, 28, 29], 2)]
    chunked = sequence(long_prompt, 3)
    scheduler.submit([chunked])
    assert scheduler.wait_until_idle(60)
    assert backend.prefills == [(0, 0, 16), (0, 16, 16), (0, 32, 5)]
    assert collector.tokens(chunked) == oracle.generate(long_prompt, max_new_tokens=3).token_ids
    assert all(len(batch) == 1 for batch in backend.batches)  # one chunk a step: the next waits for the next step
    backend.prefills.clear()
    backend.batches.clear()
    scheduler.submit(short)
    assert scheduler.wait_until_idle(60)
    # both prompts in one prefill_batch call, each from the start of the prompt
    assert [[(start, length) for _, start, length in batch] for batch in backend.batches] == [[(0, 10), (0, 9)]]
    assert [collector.tokens(s) for s in short] == [oracle.generate(s.prompt_ids, max_new_tokens=2).token_ids
                                                    for s in short]


def test_a_step_prefills_the_oldest_chunks_up_to_its_token_budget(checkpoint, oracle):
    """Three prompts of 10, 9 and 21 tokens (chunks of 16, 20 tokens a step): step 1 prefills the first two
    (19 tokens); the third's first chunk (16) would pass 20, so it waits; then its two chunks, a step each."""
    collector = Collector()
    backend = RecordingBackend(load(checkpoint, max_batch=3).model)
    scheduler = Scheduler(backend, max_num_seqs=3, prefill_chunk=16, max_prefill_tokens=20, emit=collector)
    prompts = [list(range(30, 40)), list(range(50, 59)), [(11 * i) % 900 + 40 for i in range(21)]]
    sequences = [sequence(p, 3) for p in prompts]
    scheduler.submit(sequences)  # queued before the engine starts: all three are admitted in its first step
    scheduler.start()
    try:
        assert scheduler.wait_until_idle(60)
    finally:
        scheduler.stop()
    assert [[(start, length) for _, start, length in batch] for batch in backend.batches] == [
        [(0, 10), (0, 9)], [(0, 16)], [(16, 5)]]
    assert max(step.prefill_tokens for step in scheduler.statistics.recent) == 19
    assert [collector.tokens(s) for s in sequences] == [oracle.generate(p, max_new_tokens=3).token_ids
                                                        for p in prompts]
    with pytest.raises(ValueError, match="max_prefill_tokens must be >= prefill_chunk"):
        Scheduler(backend, prefill_chunk=16, max_prefill_tokens=8)


def test_an_abort_frees_the_slot_within_a_step(engine):
    scheduler, backend, collector = engine
    running = sequence([7, 8, 9], 200)
    scheduler.submit([running])
    collector.wait_for(running, 3)
    slot = running.slot
    decodes_at_abort = len(backend.decodes)
    scheduler.abort([running])
    assert scheduler.wait_until_idle(10)
    assert sum(slot in slots for slots in backend.decodes[decodes_at_abort:]) <= 1  # one step already on its way
    assert len(collector.tokens(running)) < 200 and running.slot is None
    assert sorted(scheduler.free_slots) == [0, 1] and scheduler.statistics.aborted == 1
    follower = sequence([7, 8, 9], 2)
    scheduler.submit([follower])
    assert scheduler.wait_until_idle(10) and len(collector.tokens(follower)) == 2


def test_the_queue_takes_all_of_a_request_or_none(engine):
    scheduler, backend, collector = engine
    first = [sequence([1, 2, 3], 100) for _ in range(5)]
    scheduler.submit(first)  # 2 running, 3 waiting
    with pytest.raises(QueueFull, match="room for 6"):
        scheduler.submit([sequence([1, 2], 2), sequence([1, 2], 2)])
    scheduler.submit([sequence([1, 2], 2)])  # exactly full
    with pytest.raises(QueueFull):
        scheduler.submit([sequence([1, 2], 2)])
    with pytest.raises(ValueError, match="leaves no room"):
        scheduler.submit([sequence([1] * scheduler.max_length, 2)])
    scheduler.abort(first)
    assert scheduler.wait_until_idle(30)


def test_a_failing_step_fails_its_sequences_and_the_engine_goes_on(engine):
    scheduler, backend, collector = engine
    victims = [sequence([4, 5, 6], 20), sequence([6, 5, 4], 20)]
    scheduler.submit(victims)
    collector.wait_for(victims[0], 2)
    backend.fail_next_decode = True
    assert scheduler.wait_until_idle(10)
    for victim in victims:
        assert "simulated device failure" in collector.outputs[victim.identity][-1].error
    backend.poison_slot = 1
    pair = [sequence([4, 5, 6], 3), sequence([6, 5, 4], 3)]
    scheduler.submit(pair)
    assert scheduler.wait_until_idle(10)
    outputs = [collector.outputs[s.identity][-1] for s in pair]
    # only the row of the poisoned slot fails
    assert sorted([o.finish_reason or "NaN" in o.error for o in outputs], key=str) == [True, "length"]
    assert sorted(scheduler.free_slots) == [0, 1]


def test_stop_aborts_what_is_left_and_admits_nothing_more(checkpoint):
    collector = Collector()
    scheduler = Scheduler(load(checkpoint, max_batch=1).model, max_queue=2, emit=collector)
    scheduler.start()
    running, waiting = sequence([1, 2, 3], 200), sequence([3, 2, 1], 200)
    scheduler.submit([running, waiting])
    collector.wait_for(running, 2)
    scheduler.stop(timeout=0.05)
    assert not scheduler.alive
    assert collector.outputs[running.identity][-1].error == STOPPING
    assert collector.outputs[waiting.identity][-1].error == STOPPING
    with pytest.raises(ShuttingDown):
        scheduler.submit([sequence([1], 1)])


def test_a_backend_without_slotted_decode_is_refused_clearly(checkpoint):
    class Unslotted:
        config, device, max_batch, max_length = None, torch.device("cpu"), 1, 8

        def decode(self, token_ids, positions):
            raise AssertionError("never called")

    Unslotted.config = load(checkpoint, max_batch=1).config
    with pytest.raises(TypeError, match="decode has no slots= argument"):
        Scheduler(Unslotted())
