"""DecodePipeline's groups of steps (engine/decode_pipeline.py) on the CPU: the ids handed back equal
stepping one at a time, for every group size, sampling mode, early stop and the end of the cache.

A decode step of the real model costs seconds under Triton's interpreter, so these tests run the pipeline
on a TritonModel whose transformer is replaced by a stand-in step (`StandInStep`): everything else is the
engine's own code, TritonModel.decode_tokens with its groups, the decode buffers and their host rings, and
the feedback kernel that writes each step's ids into them. The stand-in's ids depend on the row's whole
history of inputs and positions and, when sampling, on the draw counter and the seed, as the model's do,
so a step run twice, skipped, fed the wrong input or drawn with the wrong counter changes the ids that
follow. The real model's steps with groups are compared in tests/engine/test_triton_engine.py."""

import pytest
import torch

from qwen_triton import LLM
from qwen_triton.engine.decode_pipeline import STEPS_PER_REPLAY, DecodePipeline
from qwen_triton.engine.sampling import SamplingParams
from qwen_triton.engine.triton_model import DeviceSampling
from tests.support import small_config, write_checkpoint

MODES = {
    "greedy": SamplingParams(),
    "temperature": SamplingParams(temperature=0.9, seed=3),
    "sample": SamplingParams(temperature=0.9, top_k=5, top_p=0.9, seed=3),
}


class StandInStep:
    """Replaces TritonModel._decode_body: a cheap step whose ids depend on each slot's history (the
    model's caches), then the model's own feedback kernel. `calls` records each decode_tokens group."""

    def __init__(self, model):
        self.model = model
        self.vocabulary = model.config.vocab_size
        self.history = torch.zeros(model.max_batch, dtype=torch.int64)
        self.calls: list[int] = []
        model._decode_body = self.step
        original = model.decode_tokens

        def decode_tokens(*arguments, **options):
            self.calls.append(options.get("group", 1))
            return original(*arguments, **options)

        model.decode_tokens = decode_tokens

    def reset(self) -> None:
        self.history.zero_()
        self.calls.clear()

    def step(self, buffers, mode, feedback=False, host_ids=None) -> None:
        size = buffers.size
        mixed = self.history[:size] * 1_000_003 + buffers.token_ids * 7_919 + buffers.positions.long() * 31 + 17
        self.history[:size] = mixed % (2**31 - 1)
        draw = 0 if mode == "greedy" else buffers.step * 104_729 + buffers.seed * 13 + 1
        buffers.next_tokens.copy_((self.history[:size] + draw) % self.vocabulary)
        if feedback:
            self.model._feed_back(buffers, host_ids)


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    directory = write_checkpoint(tmp_path_factory.mktemp("pipeline"), small_config(), layout="causal", seed=11)
    llm = LLM(directory, backend="triton", device="cpu", dtype=torch.float32, max_length=40, max_batch=2)
    return StandInStep(llm.model)


def generate(stand_in, params, starts, budgets, stop_after, ahead, steps_per_replay):
    """The host loop of LLM._generate_rows on the pipeline: row r starts at position starts[r] with id
    100 + r (its prompt's last id) and stops after budgets[r] ids (max_new_tokens or the end of the cache)
    or after stop_after[r] ids (an end-of-turn id or a stop string). Returns each row's ids."""
    stand_in.reset()
    rows = len(starts)
    sampling = DeviceSampling.build([params] * rows, "cpu")
    pipeline = DecodePipeline(stand_in.model, sampling, ahead=ahead, steps_per_replay=steps_per_replay)
    generated = [[] for _ in range(rows)]
    finished = [False] * rows
    inputs = [100 + row for row in range(rows)]
    positions = list(starts)
    steps = [0] * rows
    while True:
        tokens = pipeline.step(inputs, positions, steps, running=[not done for done in finished])
        for row in range(rows):
            if finished[row]:
                continue
            generated[row].append(tokens[row])
            finished[row] = len(generated[row]) >= min(budgets[row], stop_after[row])
        if all(finished):
            return generated
        for row in range(rows):
            if not finished[row]:  # finished rows repeat their last inputs, as LLM._generate_rows feeds them
                inputs[row], positions[row], steps[row] = generated[row][-1], positions[row] + 1, steps[row] + 1


# (starts, budgets, stop_after) under max_length 40: a step at position p needs p < 40. The rows that reach
# the end of the cache start where 40 - start is not a multiple of 2 or 4, so that their last steps do not
# fit in a whole group
SCENARIOS = {
    # one row; it stops in the middle of a group, with room left in the cache
    "stop mid-group": ([3], [37], [7]),
    # a batch of 2: row 0 stops early, row 1 runs to the end of the cache (its last step at position 39)
    "early stop, end of cache": ([3, 21], [37, 19], [5, 99]),
    # row 1 nears the end of the cache first (single steps), stops there, and row 0 goes on in groups
    "end of cache, then groups again": ([2, 31], [25, 9], [99, 99]),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("mode", MODES)
def test_groups_hand_back_the_ids_of_one_step_at_a_time(stand_in, scenario, mode):
    starts, budgets, stop_after = SCENARIOS[scenario]
    one_at_a_time = generate(stand_in, MODES[mode], starts, budgets, stop_after, ahead=False, steps_per_replay=1)
    assert set(stand_in.calls) == {1}
    assert [len(ids) for ids in one_at_a_time] == [min(b, s) for b, s in zip(budgets, stop_after)]
    for steps_per_replay in (1, 2, 4):
        grouped = generate(stand_in, MODES[mode], starts, budgets, stop_after, ahead=True,
                           steps_per_replay=steps_per_replay)
        assert grouped == one_at_a_time, f"steps_per_replay={steps_per_replay}"
        calls = stand_in.calls
        assert calls.count(steps_per_replay) >= 2  # the groups ran (two launched at the first step)
        if steps_per_replay > 1 and scenario != "stop mid-group":
            assert 1 in calls  # single steps at the end of the cache
        if steps_per_replay > 1 and scenario == "end of cache, then groups again":
            last_group = len(calls) - 1 - calls[::-1].index(steps_per_replay)
            assert calls.index(1) < last_group, calls


@pytest.mark.parametrize("start, launches", [(32, [4, 4]), (30, [4, 4, 1, 1])])
def test_groups_run_up_to_the_last_position_and_single_steps_after_them(stand_in, start, launches):
    # max_length 40, groups of 4, the row's steps at start..39: from 32, the launch and the group ahead of it
    # end exactly at 39; from 30 they end at 37, a group would end past 39, and 38 and 39 run as single steps
    params, budget = MODES["temperature"], 40 - start
    ids = generate(stand_in, params, [start], [budget], [99], ahead=True, steps_per_replay=4)
    assert stand_in.calls == launches
    assert ids == generate(stand_in, params, [start], [budget], [99], ahead=False, steps_per_replay=1)


def test_nothing_runs_past_the_group_in_flight(stand_in):
    # one id asked for with groups of 4: the host's launch and the group ahead of it, nothing more
    generate(stand_in, MODES["greedy"], [3], [37], [1], ahead=True, steps_per_replay=4)
    assert stand_in.calls == [4, 4]


def test_the_default_group_and_bad_group_sizes(stand_in):
    sampling = DeviceSampling.build([SamplingParams()], "cpu")
    assert DecodePipeline(stand_in.model, sampling).steps_per_replay == STEPS_PER_REPLAY
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="steps_per_replay must be a positive int"):
            DecodePipeline(stand_in.model, sampling, steps_per_replay=bad)
    ids, positions, steps = torch.tensor([1]), torch.tensor([0]), torch.tensor([0])
    with pytest.raises(ValueError, match="needs feedback=True"):
        stand_in.model.decode_tokens(ids, positions, sampling, steps, group=2)
    with pytest.raises(ValueError, match="group must be a positive int"):
        stand_in.model.decode_tokens(ids, positions, sampling, steps, feedback=True, group=0)


def test_a_group_writes_each_step_into_its_own_row_of_the_ring(stand_in):
    # decode_tokens(group=3) on its own: the three steps' ids in rows (draw counter) % 6 of the ring of 3,
    # the same ids as three calls of one step; the one-step ring is not written
    stand_in.reset()
    sampling = DeviceSampling.build([MODES["temperature"]] * 2, "cpu")
    model = stand_in.model
    ring, single = model.chosen_on_host(2, 3), model.chosen_on_host(2)
    assert ring.shape == (6, 2) and single.shape == (2, 2)
    ring.fill_(-1)
    single.fill_(-1)
    model.decode_tokens(torch.tensor([7, 8]), torch.tensor([4, 9]), sampling, torch.tensor([5, 2]), feedback=True,
                        group=3)
    grouped = [[ring[(5 + k) % 6, 0].item(), ring[(2 + k) % 6, 1].item()] for k in range(3)]
    assert (single == -1).all()
    assert sum(int(value) == -1 for value in ring.flatten()) == 6  # 2 rows x 3 steps of 12 entries written
    stand_in.history.zero_()
    one_by_one = [model.decode_tokens(torch.tensor([7, 8]), torch.tensor([4, 9]), sampling, torch.tensor([5, 2]),
                                      feedback=True).tolist()]
    for _ in range(2):
        one_by_one.append(model.decode_tokens(None, None, sampling, None, feedback=True).tolist())
    assert grouped == one_by_one
