"""Several prompts in one packed prefill pass (`TritonModel.prefill_batch`, engine/packed.py, operators/packed.py):
each prompt's last logits, its slot's conv and recurrent states and its KV cache equal those of one prefill each,
the decode steps from those slots equal, a prompt continued after cached tokens (start > 0) equals one pass over
all of it, and no padding row touches another slot. On the CPU under the interpreter in float32 (a two-layer
config, a DeltaNet and an attention layer); on the GPU at the 0.8B shape in bf16 through the packed CUDA graphs,
where a prompt of a length the process has not seen replays its bucket's graph."""

import time
import warnings

import pytest
import torch

from qwen_triton import LLM
from qwen_triton.engine import packed
from qwen_triton.operators.packed import ALIGN, PackedLayout
from tests.support import relative_error, small_config, write_checkpoint

LENGTHS = (1, 5, 63, 64, 65, 130)
SLOTS = (4, 0, 6, 2, 5, 1)  # any order; slots 3 and 7 hold bystanders
BYSTANDERS = (3, 7)


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 300, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    config = small_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    return write_checkpoint(tmp_path_factory.mktemp("packed"), config, layout="causal", seed=31)


@pytest.fixture(scope="module")
def model(directory):
    if torch.cuda.is_available():
        pytest.skip("the triton backend on the CPU runs interpreted, in CI; a GPU machine runs this file's gpu tests")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(directory, backend="triton", device="cpu", dtype=torch.float32, max_length=576,
                   max_batch=8).model


def slot_states(model, slot: int, length: int) -> dict:
    """Copies of a slot's states: its conv and recurrent states, and its KV cache's first `length` positions."""
    state = model.state
    tensors = {f"conv.{i}": t[slot] for i, t in state.conv.items()}
    tensors.update({f"recurrent.{i}": t[slot] for i, t in state.recurrent.items()})
    tensors.update({f"key.{i}": t[slot, :, :length] for i, t in state.key.items()})
    tensors.update({f"value.{i}": t[slot, :, :length] for i, t in state.value.items()})
    return {name: tensor.clone() for name, tensor in tensors.items()}


def fill_bystanders(model) -> dict:
    """Random states in the bystander slots (the whole KV cache); returns copies."""
    generator = torch.Generator().manual_seed(5)
    for tensors in (model.state.conv, model.state.recurrent, model.state.key, model.state.value):
        for tensor in tensors.values():
            for slot in BYSTANDERS:
                tensor[slot] = torch.randn(tensor.shape[1:], generator=generator)
    return {slot: slot_states(model, slot, model.max_length) for slot in BYSTANDERS}


def assert_states_close(ours: dict, theirs: dict, tolerance: float = 2e-5) -> None:
    for name, tensor in ours.items():
        assert relative_error(tensor, theirs[name]) <= tolerance, name


def decode_rows(model, prompts, slots, steps: int = 2) -> torch.Tensor:
    """Greedy decode steps of every slot together, the rows in reversed slot order."""
    order = list(reversed(range(len(slots))))
    tokens = torch.tensor([7 + row for row in order])
    positions = torch.tensor([prompts[row].shape[0] for row in order])
    rows = []
    for _ in range(steps):
        logits = model.decode(tokens, positions, slots=torch.tensor([slots[row] for row in order]))
        rows.append(logits)
        tokens, positions = logits.argmax(-1), positions + 1
    return torch.cat(rows)


@pytest.mark.slow
def test_prefill_batch_equals_one_prefill_each(model):
    """Six prompts of 1 to 130 tokens in slots in any order, in one pass of a 576-row bucket: each prompt's last
    logits, its slot's states and KV cache as one prefill each (the one-sequence kernels), decode steps after them
    equal, and the bystander slots untouched."""
    prompts = [prompt(length, seed) for seed, length in enumerate(LENGTHS)]
    assert packed.token_bucket(PackedLayout.of(LENGTHS).used, model.packed_buckets) == 576
    model.reset()
    bystanders = fill_bystanders(model)
    together = model.prefill_batch(prompts, list(SLOTS))
    states = {slot: slot_states(model, slot, length) for slot, length in zip(SLOTS, LENGTHS)}
    for slot, saved in bystanders.items():
        assert all(torch.equal(tensor, saved[name]) for name, tensor in slot_states(model, slot, 576).items()), slot
    steps = decode_rows(model, prompts, SLOTS)

    model.reset()
    alone = torch.cat([model.prefill(ids, slot, all_logits=False) for ids, slot in zip(prompts, SLOTS)])
    assert together.shape == alone.shape == (len(LENGTHS), model.config.vocab_size)
    assert relative_error(together, alone) <= 2e-5
    for slot, length in zip(SLOTS, LENGTHS):
        assert_states_close(states[slot], slot_states(model, slot, length))
    assert relative_error(steps, decode_rows(model, prompts, SLOTS)) <= 2e-5


@pytest.mark.slow
def test_a_prompt_continued_in_a_packed_pass_equals_one_pass(model):
    """Three prompts prefilled in two packed passes, the second after each one's cached first part (start > 0, slots
    in another order, one part shorter than the conv's W-1 inputs): the last logits and the states of one pass over
    each whole prompt."""
    firsts, seconds, slots = (40, 3, 70), (30, 65, 1), (2, 0, 5)
    prompts = [prompt(a + b, 10 + index) for index, (a, b) in enumerate(zip(firsts, seconds))]
    model.reset()
    model.prefill_batch([ids[:n] for ids, n in zip(prompts, firsts)], list(slots))
    order = [2, 0, 1]
    continued = model.prefill_batch([prompts[i][firsts[i]:] for i in order], [slots[i] for i in order],
                                    [firsts[i] for i in order])
    states = {slots[i]: slot_states(model, slots[i], firsts[i] + seconds[i]) for i in range(3)}
    model.reset()
    whole = torch.cat([model.prefill(prompts[i], slots[i], all_logits=False) for i in order])
    assert relative_error(continued, whole) <= 2e-5
    for i in range(3):
        assert_states_close(states[slots[i]], slot_states(model, slots[i], firsts[i] + seconds[i]))


@pytest.mark.slow
def test_prompts_beyond_one_pass_run_in_several(directory):
    """max_length 64: the largest bucket holds one aligned prompt, so three prompts run three passes."""
    model = LLM(directory, backend="triton", device="cpu", dtype=torch.float32, max_length=64, max_batch=4).model
    assert model.packed_buckets == [64]
    prompts = [prompt(length, 20 + length) for length in (3, 60, 1)]
    together = model.prefill_batch(prompts, [1, 3, 0])
    model.reset()
    alone = torch.cat([model.prefill(ids, slot, all_logits=False) for ids, slot in zip(prompts, [1, 3, 0])])
    assert relative_error(together, alone) <= 2e-5


def test_prefill_batch_refuses_bad_arguments(model):
    ids = torch.tensor([1, 2])
    for arguments, message in [(([ids, ids], [1, 1]), "distinct"), (([ids], [8]), "distinct"),
                               (([ids], [0, 1]), "slots has 2"), (([], []), "at least one"),
                               (([torch.tensor([], dtype=torch.long)], [0]), "non-empty"),
                               (([ids, ids], [0, 1], [575, 0]), "exceed the maximum length 576"),
                               (([ids], [0], [0, 0]), "starts has 2")]:
        with pytest.raises(ValueError, match=message):
            model.prefill_batch(*arguments)


@pytest.mark.slow
def test_generate_prefills_a_list_of_prompts_in_one_prefill_batch(directory, monkeypatch):
    llm = LLM(directory, backend="triton", device="cpu", dtype=torch.float32, max_length=32, max_batch=4)
    calls = []
    batch = llm.model.prefill_batch
    monkeypatch.setattr(llm.model, "prefill_batch",
                        lambda *args, **kwargs: calls.append(args) or batch(*args, **kwargs))
    prompts = [[5, 6, 7], [100, 3], [9, 9, 9, 9, 1]]
    together = llm.generate(prompts, max_new_tokens=2)
    assert len(calls) == 1 and [ids.tolist() for ids in calls[0][0]] == prompts and calls[0][1] == [0, 1, 2]
    assert [r.token_ids for r in together] == [llm.generate(p, max_new_tokens=2).token_ids for p in prompts]


# ---- the layout and the buckets (no kernels) ----------------------------------------------------------------------
def test_token_buckets():
    """Every multiple of 64 up to 512, then steps of at most 12.5%, each a multiple of 64, to max_length rounded up."""
    for max_length in (4, 64, 500, 4096, 4200, 32768):
        buckets = packed.token_buckets(max_length)
        assert buckets[-1] == -(-max_length // ALIGN) * ALIGN
        assert all(b % ALIGN == 0 for b in buckets) and buckets == sorted(set(buckets))
        assert buckets[:8] == list(range(64, min(512, buckets[-1]) + 1, 64))
        assert all(later <= earlier * 1.125 for earlier, later in zip(buckets[7:], buckets[8:-1]))
    assert len(packed.token_buckets(4096)) < 32
    assert packed.token_bucket(577, packed.token_buckets(4096)) == 640
    with pytest.raises(ValueError, match="exceed the largest"):
        packed.token_bucket(4160, packed.token_buckets(4096))


def test_passes_group_prompts_in_order():
    assert packed.passes([1, 5, 63, 64, 65, 130], 4096) == [[0, 1, 2, 3, 4, 5]]
    assert packed.passes([100, 30, 1, 200], 256) == [[0, 1, 2], [3]]
    assert packed.passes([200, 100, 64], 256) == [[0], [1, 2]]
    with pytest.raises(ValueError, match="prompt 1 has 300 tokens"):
        packed.passes([1, 300], 256)


def test_pack_inputs_lays_the_prompts_out():
    prompts = [torch.tensor([4, 5, 6]), torch.arange(10, 80)]
    host, layout = packed.pack_inputs(prompts, [2, 0], [3, 1], 256, 4)
    inputs = packed.PackedInputs.view(host, 256, 4)
    assert layout.firsts == (0, 64) and host.dtype == torch.int32 and host.numel() == packed.input_size(256, 4)
    assert inputs.token_ids[:3].tolist() == [4, 5, 6] and inputs.token_ids[64:134].tolist() == list(range(10, 80))
    assert (inputs.token_ids[3:64] == 0).all() and (inputs.token_ids[134:] == 0).all()
    assert inputs.positions[:3].tolist() == [2, 3, 4] and inputs.positions[64:134].tolist() == list(range(70))
    assert torch.equal(inputs.slots, layout.token_slots()) and torch.equal(inputs.positions, layout.positions())
    assert torch.equal(inputs.blocks, layout.blocks())
    assert inputs.blocks.tolist() == [[0, 3, 2, 3], [64, 70, 0, 1], [64, 70, 0, 1], [0, 0, 0, -1]]
    assert inputs.last_rows.tolist() == [2, 133, 0, 0]


# ---- GPU: the 0.8B shape in bf16, through the packed CUDA graphs -------------------------------------------------
GPU_LENGTHS = (1, 5, 63, 64, 65, 130, 700, 1531)


def _gpu_llm(**options):
    from qwen_triton.benchmark.models import random_llm

    return random_llm("0.8b", max_length=4096, max_batch=16, **options)


@pytest.mark.gpu
def test_gpu_prefill_batch_equals_one_prefill_each():
    """Eight prompts of 1 to 1,531 tokens in slots in any order, one pass (replayed from its bucket's graph on the
    second call): each prompt's last logits and its slot's states as one prefill each (the one-sequence kernels,
    eagerly), within bf16's roundings (the pass runs chunks of 64 where a short prompt alone runs chunks of 32);
    decode steps after them agree."""
    llm = _gpu_llm(warm_up=False)
    model = llm.model
    slots = [3, 0, 7, 1, 6, 2, 5, 4]
    prompts = [prompt(length, seed).cuda() for seed, length in enumerate(GPU_LENGTHS)]
    for _ in range(2):  # the bucket's first pass runs eagerly and is captured; the second replays the graph
        model.reset()
        together = model.prefill_batch([ids.cpu() for ids in prompts], slots)
    assert len(model.packed_graphs.bodies) == 1
    states = {slot: slot_states(model, slot, length) for slot, length in zip(slots, GPU_LENGTHS)}
    steps = decode_rows(model, prompts, slots)
    model.reset()
    alone = torch.cat([model.prefill_eager(ids, slot, 0, False) for ids, slot in zip(prompts, slots)])
    assert torch.isfinite(together).all()
    assert relative_error(together, alone) < 3e-2
    assert (together.argmax(-1) == alone.argmax(-1)).float().mean() >= 0.75
    # a deep layer's states are functions of that layer's bf16 input (the recurrent state of a one-token prompt
    # k v^T beta: two factors): the two paths' roundings (GEMM tiles against the GEMV, chunks of 64 against 32)
    # compound through the layers before it, as the reference's own bf16 does (its logits 3.2e-2 from float32's,
    # median; 3.5e-2 and 5.2e-2 measured at layers 16 and 17 of the one-token prompt); a state of another slot or
    # position would be off by 1e0
    for slot, length in zip(slots, GPU_LENGTHS):
        for name, tensor in slot_states(model, slot, length).items():
            assert relative_error(states[slot][name], tensor) < 1e-1, (slot, name)
    assert relative_error(steps, decode_rows(model, prompts, slots)) < 5e-2


@pytest.mark.gpu
def test_gpu_a_prompt_of_an_unseen_length_replays_a_graph(monkeypatch):
    """After the warm-up a prompt of a length never seen neither compiles, tunes nor captures: it replays its
    bucket's graphs. Prints its time to the first token against the one-sequence graph of that length (captured
    for the comparison), and 16 prompts of 128 tokens in one pass against one prefill each."""
    import triton
    from triton.runtime.autotuner import Autotuner

    llm = _gpu_llm(warm_up=True)
    model = llm.model
    assert sorted(model.packed_graphs.bodies) == model.packed_buckets
    captured = len(model.packed_graphs.bodies), len(model.packed_graphs.heads)
    compiled, benchmarked = [], []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **details: compiled.append(details["repr"])
                        and False)
    bench = Autotuner._bench
    monkeypatch.setattr(Autotuner, "_bench", lambda tuner, *args, **kwargs: benchmarked.append(tuner.fn)
                        or bench(tuner, *args, **kwargs))

    def first_token_ms(call, repeats=5):
        times = []
        for _ in range(repeats):
            model.reset()
            torch.cuda.synchronize()
            began = time.perf_counter()
            call()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - began) * 1e3)
        return sorted(times)[len(times) // 2]

    for length in (100, 1531, 3000):
        ids = prompt(length, length)
        packed_ms = first_token_ms(lambda: model.prefill(ids, 0, all_logits=False))
        assert (len(model.packed_graphs.bodies), len(model.packed_graphs.heads)) == captured
        assert not compiled and not benchmarked, (compiled[:3], benchmarked[:3])
        device_ids = ids.cuda()
        model.prefill_graphs.run(device_ids, 0, False, lambda x: model.prefill_eager(x, 0, 0, False))  # eager
        model.prefill_graphs.run(device_ids, 0, False, lambda x: model.prefill_eager(x, 0, 0, False))  # captured
        exact_ms = first_token_ms(lambda: model.prefill_graphs.run(
            device_ids, 0, False, lambda x: model.prefill_eager(x, 0, 0, False)))
        print(f"\n{length} tokens: packed graph {packed_ms:.3f} ms, the length's own graph {exact_ms:.3f} ms "
              f"({packed_ms / exact_ms:.2f}x)")
    prompts = [prompt(128, 100 + s) for s in range(16)]
    batch_ms = first_token_ms(lambda: model.prefill_batch(prompts, list(range(16))))
    one_each_ms = first_token_ms(lambda: [model.prefill(ids, slot, all_logits=False)
                                          for slot, ids in enumerate(prompts)])
    assert not compiled and not benchmarked, (compiled[:3], benchmarked[:3])
    print(f"16 x 128 tokens: one prefill_batch {batch_ms:.3f} ms, one prefill each {one_each_ms:.3f} ms")
