"""A decode step over any set of sequence slots (`decode(token_ids, positions, slots)`): row r decodes the sequence
in slot slots[r]. Three prompts are prefilled into slots 2, 0 and 3 of a four-slot model, slot 1 holds a bystander
sequence's state; decoded together as rows in the shuffled slot order [3, 2, 0], each row equals its slot decoded
alone (logits and states), and neither the rows nor the bucket's padding row (three rows run a bucket of four) touch
any other slot. Both backends; the Triton one under the interpreter in float32 on the CPU (a two-layer config, one
DeltaNet and one attention layer, whose head dims let a one-row step run the projected DeltaNet kernel and a
three-row step the fused one). On the GPU the same at the 0.8B shape in bf16, through CUDA graphs replayed with
changing slot sets."""

import importlib
import warnings

import pytest
import torch

from qwen_triton import LLM
from qwen_triton.engine.device_sampling import DeviceSampling
from qwen_triton.engine.sampling import SamplingParams
from tests.support import relative_error, small_config, write_checkpoint

PROMPTS = {2: [5, 6, 7], 0: [100, 3], 3: [9, 9, 9, 9, 1]}
ORDER = [3, 2, 0]  # the rows' slots in the step
NEXT_IDS = [11, 12, 13]  # the rows' inputs
BYSTANDER = 1  # a slot whose sequence is not in the step


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    config = small_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                          linear_key_head_dim=16, linear_value_head_dim=32)
    return write_checkpoint(tmp_path_factory.mktemp("slots"), config, layout="causal", seed=21)


def load(directory, backend, **options):
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("the triton backend on the CPU runs interpreted, in CI; a GPU machine runs this file's gpu tests")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(directory, backend=backend, device="cpu", dtype=torch.float32, max_length=16, max_batch=4,
                   **options).model


def states(model, history: bool = False):
    """Every per-sequence state tensor of a backend ([slot, ...]) by name: the caches, and with history the
    Triton backend's penalties' history (once allocated)."""
    cache = model.state if hasattr(model, "state") else model.cache
    tensors = {f"{kind}.{layer}": tensor for kind in ("key", "value", "conv", "recurrent")
               for layer, tensor in getattr(cache, kind).items()}
    penalties = getattr(model, "history", None)
    if history and penalties is not None and penalties.counts is not None:
        tensors.update(counts=penalties.counts, prompt_mask=penalties.prompt_mask)
    return tensors


def snapshot(model) -> dict:
    return {name: tensor.clone() for name, tensor in states(model, history=True).items()}


def restore(model, saved: dict) -> None:
    for name, tensor in states(model, history=True).items():
        tensor.copy_(saved[name])


@pytest.fixture(scope="module")
def prefilled(directory):
    """Per backend: the model with the prompts prefilled into their slots and random state in the bystander slot,
    the prefills' last logits by slot, and a snapshot of the states to start each test from."""
    made = {}

    def get(backend):
        if backend not in made:
            model = load(directory, backend)
            logits = {}
            for slot, ids in PROMPTS.items():
                model.reset(slot)
                logits[slot] = model.prefill(torch.tensor(ids), slot=slot, all_logits=False)
            if backend == "triton":
                model.history.tensors()  # allocated now, so that each test starts from no history
            generator = torch.Generator().manual_seed(3)
            for tensor in states(model).values():
                tensor[BYSTANDER] = torch.randn(tensor.shape[1:], generator=generator).to(tensor.dtype)
            made[backend] = model, logits, snapshot(model)
        model, logits, start = made[backend]
        restore(model, start)
        return model, logits

    return get


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_decode_over_slots_equals_each_slot_alone(prefilled, backend):
    model, _ = prefilled(backend)
    before = snapshot(model)
    positions = [len(PROMPTS[slot]) for slot in ORDER]
    together = model.decode(torch.tensor(NEXT_IDS), torch.tensor(positions), torch.tensor(ORDER))
    after = snapshot(model)
    for name, tensor in after.items():  # the rows and the padding row wrote nothing of the bystander's
        assert torch.equal(tensor[BYSTANDER], before[name][BYSTANDER]), name
    after = {name: after[name] for name in states(model)}
    for row, slot in enumerate(ORDER):
        restore(model, before)
        alone = model.decode(torch.tensor(NEXT_IDS[row:row + 1]), torch.tensor(positions[row:row + 1]),
                             torch.tensor([slot]))
        assert relative_error(together[row], alone[0]) <= 1e-5, (row, slot)
        for name, tensor in states(model).items():
            assert relative_error(after[name][slot], tensor[slot]) <= 1e-5, (name, slot)
            assert not torch.equal(after[name][slot], before[name][slot]), (name, slot)  # the step wrote it


def test_the_resident_gemm_serves_decode_steps_not_prefills(prefilled, monkeypatch):
    """A decode step of 2-16 rows runs its projections through the resident-weights GEMM; a prefill of as many tokens
    keeps the tiled GEMM, so that a prompt prefilled alone gets the bits of its packed pass (docs/decisions.md,
    D172)."""
    module = importlib.import_module("qwen_triton.operators.linear.linear")
    model, _ = prefilled("triton")
    real, rows = module.resident_gemm, []

    def recorded(x, *args, **kwargs):
        rows.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(module, "resident_gemm", recorded)
    model.reset(BYSTANDER)
    model.prefill(torch.tensor([4, 5, 6, 7, 8]), slot=BYSTANDER, all_logits=False)
    assert rows == []
    positions = [len(PROMPTS[slot]) for slot in ORDER]
    model.decode(torch.tensor(NEXT_IDS), torch.tensor(positions), torch.tensor(ORDER))
    assert rows and set(rows) == {4}  # three rows in a bucket of four, every projection of the step


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bad_slots_are_refused_before_any_work(prefilled, backend):
    model, _ = prefilled(backend)
    ids, positions = torch.tensor([1, 2]), torch.tensor([0, 0])
    for slots, message in (([1, 1], "distinct"), ([0, 4], "distinct slots in 0..3"), ([0, -1], "0..3"),
                           ([0], "shape"), ([0.0, 1.0], "dtype")):
        with pytest.raises(ValueError, match=message):
            model.decode(ids, positions, torch.tensor(slots))


def test_penalties_history_follows_the_slot(prefilled):
    """The penalties' history is each slot's (engine/buffers.py, PenaltyHistory): choose_first_rows starts slot s's,
    and a penalized step over rows [3, 2] (a bucket of two) reads and advances the history of each row's slot as
    a one-row step of that slot alone does (a bucket of one, other buffers)."""
    model, prefill_logits = prefilled("triton")
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3)
    order = [3, 2]
    sampling = DeviceSampling.build([params] * len(order), torch.device("cpu"))
    chosen = model.choose_first_rows(torch.cat([prefill_logits[slot] for slot in order]), sampling,
                                     [torch.tensor(PROMPTS[slot]) for slot in order], slots=order)
    first = {slot: int(chosen[row]) for row, slot in enumerate(order)}
    assert [int(model.history.counts[slot].sum()) for slot in range(4)] == [0, 0, 1, 1]  # the first ids
    before = snapshot(model)
    steps = torch.ones(len(order), dtype=torch.int64)
    together = model.decode_tokens(torch.tensor([first[slot] for slot in order]),
                                   torch.tensor([len(PROMPTS[slot]) for slot in order]), sampling, steps,
                                   slots=torch.tensor(order)).clone()
    after = snapshot(model)
    assert [int(after["counts"][slot].sum()) for slot in range(4)] == [0, 0, 2, 2]
    alone_sampling = DeviceSampling.build([params], torch.device("cpu"))
    for row, slot in enumerate(order):
        restore(model, before)
        alone = model.decode_tokens(torch.tensor([first[slot]]), torch.tensor([len(PROMPTS[slot])]), alone_sampling,
                                    steps[:1], slots=torch.tensor([slot]))
        assert int(alone[0]) == int(together[row]), (row, slot)
        assert torch.equal(model.history.counts[slot], after["counts"][slot])
    with pytest.raises(ValueError, match="slots all as None"):
        model.decode_tokens(None, None, sampling, None, slots=torch.tensor(order))


def test_a_graph_warm_up_restores_the_states_of_its_rows_slots(prefilled):
    """DecodeGraphs' warm-up runs a step for real before capturing it: save_states / restore_states keep what it
    advances, the states of the rows' slots (padding rows' -1 read as slot 0's, restored unchanged) and the
    penalties' counts, gathered and scattered on the device."""
    from qwen_triton.engine.graphs import restore_states, save_states

    model, _ = prefilled("triton")
    saved_slots = torch.tensor([3, 0, -1, -1], dtype=torch.int32)
    before = snapshot(model)
    saved = save_states(model.state, model.history, saved_slots)
    advanced = [tensor for name, tensor in states(model, history=True).items()
                if name.startswith(("conv", "recurrent", "counts"))]
    for tensor in advanced:
        tensor.add_(1)
    restore_states(model.state, model.history, saved)
    for name, tensor in states(model, history=True).items():
        if name.startswith(("conv", "recurrent", "counts")):
            for slot in range(4):
                expected = before[name][slot] if slot in (0, 3) else before[name][slot] + 1
                assert torch.equal(tensor[slot], expected), (name, slot)
        else:  # the KV cache (rewritten by the replay as the warm-up wrote it) and the prompt masks: not saved
            assert torch.equal(tensor, before[name]), name


# ---- GPU, the 0.8B shape in bf16, CUDA graphs ---------------------------------------------------------------

# each step's rows' slots: a bucket of four with a padding row (three rows), a full one, one of two, one row
GPU_STEPS = [[3, 0, 2], [1, 3, 0, 2], [2, 1, 3], [0, 2], [3], [1, 3, 0]]


def _real_model(**options):
    from qwen_triton.benchmark.models import random_llm

    return random_llm("0.8b", backend="triton", dtype=torch.bfloat16, max_length=512, max_batch=4, **options).model


def _decode_steps(model, prompts, steps, tokens=False):
    """Prefill each prompt into its slot, then decode `steps` (each a list of slots) as logits steps (tokens: greedy
    decode_tokens steps, the next ids fed in by the host); returns each step's result and the states after it
    (the slots' of every step, so a missing slot's must stay as the step before left it)."""
    for slot, ids in enumerate(prompts):
        model.reset(slot)
        model.prefill(torch.tensor(ids, device="cuda"), slot=slot, all_logits=False)
    lengths = [len(ids) for ids in prompts]
    inputs = [ids[-1] for ids in prompts]
    results, after = [], []
    for slots in steps:
        ids = torch.tensor([inputs[slot] for slot in slots], device="cuda")
        positions = torch.tensor([lengths[slot] for slot in slots], device="cuda")
        slot_tensor = torch.tensor(slots, device="cuda", dtype=torch.int32)
        if tokens:
            sampling = DeviceSampling.build([SamplingParams()] * len(slots), model.device)
            chosen = model.decode_tokens(ids, positions, sampling, torch.zeros(len(slots), dtype=torch.int64,
                                                                                device="cuda"), slots=slot_tensor)
            result = chosen.clone()
        else:
            result = model.decode(ids, positions, slot_tensor)
            chosen = result.argmax(-1)
        for slot, token in zip(slots, chosen.tolist()):
            inputs[slot], lengths[slot] = token, lengths[slot] + 1
        results.append(result)
        after.append({name: tensor.clone() for name, tensor in states(model).items()})
    return results, after


GPU_PROMPTS = [[5, 6, 7, 8], list(range(100, 140)), [9] * 17, [42] * 3]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [False, True])
def test_gpu_graphs_replayed_over_changing_slot_sets_equal_eager_steps(tokens):
    """At the 0.8B shape in bf16: each (bucket, mode) step captured once and replayed with the slot sets of
    GPU_STEPS written into its slots buffer computes what the same steps launched eagerly compute, bit for bit
    (logits, or greedy ids from decode_tokens), and leaves every state as they do; a slot not in a step keeps its
    states bit for bit (the padding row of a bucket included)."""
    graphed = _real_model()
    results, after = _decode_steps(graphed, GPU_PROMPTS, GPU_STEPS, tokens)
    assert len(graphed.decode_graphs.graphs) == 3  # buckets 4, 2 and 1, each replayed with other slot sets
    del graphed
    torch.cuda.empty_cache()
    eager = _real_model(cuda_graph=False)
    expected, expected_after = _decode_steps(eager, GPU_PROMPTS, GPU_STEPS, tokens)
    for step, slots in enumerate(GPU_STEPS):
        assert torch.equal(results[step], expected[step]), (step, slots)
        for name, tensor in after[step].items():
            assert torch.equal(tensor, expected_after[step][name]), (step, name)
            if step:
                for slot in set(range(4)) - set(slots):
                    assert torch.equal(tensor[slot], after[step - 1][name][slot]), (step, name, slot)


@pytest.mark.gpu
def test_gpu_rows_over_slots_equal_each_slot_alone():
    """At the 0.8B shape in bf16 through CUDA graphs: three rows in the shuffled slot order [3, 0, 2] (a bucket of
    four with a padding row) against each slot decoded alone (a bucket of one: other kernels, the projected DeltaNet
    step and the staged layer tail, so within bf16 rounding, not bit for bit): the logits within 5e-2 of their
    largest (the bound of test_triton_engine's staged tail against the three launches), the same greedy token, the
    slots' states as close; the bystander slot 1 untouched, bit for bit."""
    model = _real_model()
    for slot, ids in enumerate(GPU_PROMPTS):
        model.reset(slot)
        model.prefill(torch.tensor(ids, device="cuda"), slot=slot, all_logits=False)
    order = [3, 0, 2]
    ids = torch.tensor([GPU_PROMPTS[slot][-1] for slot in order], device="cuda")
    positions = torch.tensor([len(GPU_PROMPTS[slot]) for slot in order], device="cuda")
    before = {name: tensor.clone() for name, tensor in states(model).items()}
    for _ in range(2):  # the first call captures the graph, the second replays it
        for name, tensor in states(model).items():
            tensor.copy_(before[name])
        together = model.decode(ids, positions, torch.tensor(order, device="cuda", dtype=torch.int32))
    after = {name: tensor.clone() for name, tensor in states(model).items()}
    for name, tensor in after.items():
        assert torch.equal(tensor[1], before[name][1]), name
    for row, slot in enumerate(order):
        for name, tensor in states(model).items():
            tensor.copy_(before[name])
        alone = model.decode(ids[row:row + 1], positions[row:row + 1],
                             torch.tensor([slot], device="cuda", dtype=torch.int32))
        assert relative_error(together[row], alone[0]) < 5e-2, (row, slot)
        assert int(together[row].argmax()) == int(alone[0].argmax()), (row, slot)
        for name, tensor in states(model).items():
            assert relative_error(after[name][slot], tensor[slot]) < 5e-2, (name, slot)


@pytest.mark.gpu
@pytest.mark.parametrize("resident", [False, True], ids=["tiled", "resident"])
def test_gpu_batch_invariant_rows_equal_each_slot_alone_bit_for_bit(resident):
    """With batch_invariant=True a one-row step runs the kernels of several rows: at the 0.8B shape in bf16, three
    rows (a bucket of four), two rows and each slot alone give the same logits and states, bit for bit (the decode
    GEMM tiled, and in its resident-weights form)."""
    model = _real_model(batch_invariant=True, resident_gemm=resident)
    for slot, ids in enumerate(GPU_PROMPTS):
        model.reset(slot)
        model.prefill(torch.tensor(ids, device="cuda"), slot=slot, all_logits=False)
    before = {name: tensor.clone() for name, tensor in states(model).items()}

    def decode(order):
        for name, tensor in states(model).items():
            tensor.copy_(before[name])
        ids = torch.tensor([GPU_PROMPTS[slot][-1] for slot in order], device="cuda")
        positions = torch.tensor([len(GPU_PROMPTS[slot]) for slot in order], device="cuda")
        logits = model.decode(ids, positions, torch.tensor(order, device="cuda", dtype=torch.int32))
        return {slot: logits[row] for row, slot in enumerate(order)}, {
            name: tensor.clone() for name, tensor in states(model).items()}

    together, after = decode([3, 0, 2])
    pair, _ = decode([2, 0])
    for slot in (3, 0, 2):
        alone, alone_after = decode([slot])
        assert torch.equal(together[slot], alone[slot]), slot
        if slot in pair:
            assert torch.equal(pair[slot], alone[slot]), slot
        for name, tensor in alone_after.items():
            assert torch.equal(after[name][slot], tensor[slot]), (name, slot)
