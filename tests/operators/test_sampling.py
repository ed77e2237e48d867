"""Device sampling (penalties, temperature, min-p, top-k, top-p, seeded Gumbel-max) against the engine's PyTorch
sampler.

The oracle of the kept set is qwen_triton/engine/sampling.py's `filtered_probabilities`; the oracle of
the noise is `gumbel_noise_reference` (Philox-4x32-10 in PyTorch). A draw is argmax over kept tokens of
logits / T + G, so each draw of the kernel is checked token for token against that argmax computed in
PyTorch (allowing only for a near-tie within float32 rounding of the log), and statistically: the noise
is Gumbel(0, 1) and argmax(s + G) follows softmax(s) (chi-square bounds at a 1e-6 false-alarm level
for the fixed seeds used). CPU runs use a vocabulary split in several chunks (V = 40, 3 chunks of 16),
so the cross-chunk reductions and the multi-pass threshold search run under the interpreter. The top-k
candidate path (top_k_bound) is checked against the search: the same thresholds and the same ids, rows with
ties included.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import triton
import triton.language as tl

from qwen_triton.engine.sampling import SamplingParams, filtered_probabilities, penalize
from qwen_triton.operators.sampling import (apply_penalties, benchmark_cases, count_tokens, gumbel_noise,
                                            gumbel_noise_reference, sample)

NEAR_TIE = 1e-4


def expected_draws(logits, temperature, top_k, top_p, seed, step, min_p=None):
    """Per row: the kept set by the engine's sampler, then argmax of logits / T + G (G from the reference)."""
    M, V = logits.shape
    rows = torch.arange(M)
    stream = torch.zeros(M, dtype=torch.int64) if (seed.numel() == M and M > 1) else rows
    seeds = seed.cpu().expand(M) if seed.numel() == 1 else seed.cpu()
    noise = gumbel_noise_reference(seeds[:, None], step.cpu()[:, None], stream[:, None], torch.arange(V)[None, :])
    scores = []
    for row in range(M):
        t, k, p = float(temperature[row]), int(top_k[row]), float(top_p[row])
        values = logits[row].float().cpu()
        if t == 0.0:
            scores.append(values.double())
            continue
        m = 0.0 if min_p is None else float(min_p[row])
        kept = filtered_probabilities(values, SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)) > 0
        score = (values / t + noise[row]).double()
        scores.append(score.masked_fill(~kept, float("-inf")))
    return torch.stack(scores)


def assert_draws(ids, scores):
    """Each id is the argmax of its row's scores, or within a float32 near-tie of it."""
    ids = ids.cpu()
    best = scores.max(dim=1).values
    chosen = scores.gather(1, ids[:, None])[:, 0]
    assert (chosen >= best - NEAR_TIE).all(), f"ids {ids.tolist()} expected {scores.argmax(1).tolist()}"
    clear = (scores >= best[:, None] - NEAR_TIE).sum(1) == 1
    assert torch.equal(ids[clear], scores.argmax(1)[clear])


def tensors(device, temperature, top_k, top_p, seed, step):
    return (
        torch.tensor(temperature, dtype=torch.float32, device=device),
        torch.tensor(top_k, dtype=torch.int32, device=device),
        torch.tensor(top_p, dtype=torch.float32, device=device),
        torch.tensor(seed, dtype=torch.int64, device=device),
        torch.tensor(step, dtype=torch.int64, device=device),
    )


# (temperature, top_k, top_p) per row: greedy, plain, top-k, top-p, both, top_k = 1, top_k >= V, tiny top_p
SETTINGS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 10, 0.5), (0.5, 1, 1.0),
            (2.0, 40, 0.95), (1.0, 0, 0.05)]


@pytest.mark.parametrize("per_row_seed", [False, True])
def test_sample_matches_gumbel_max_over_kept_tokens(device, per_row_seed):
    M, V = len(SETTINGS), 40
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(M, V + 3, generator=generator) * 2).to(device)[:, 1:V + 1]  # strided rows
    temperature, top_k, top_p = zip(*SETTINGS)
    seed = [7 + 3 * row for row in range(M)] if per_row_seed else [12345]
    args = tensors(device, temperature, top_k, top_p, seed, [100 + row for row in range(M)])
    ids = sample(logits, *args)
    assert ids.dtype == torch.int64 and ids.shape == (M,)
    assert_draws(ids, expected_draws(logits, *args))


def test_sample_long_row_matches_gumbel_max(device):
    """A row longer than the interpreter's INTERPRETER_WIDE_V (its wide tiles there: 4 chunks of 1536 tokens, 3
    steps of 512 each, the last chunk partial), greedy, plain, top-k and top-p rows."""
    M, V = 4, 5000
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(M, V, generator=generator) * 3).to(device)
    args = tensors(device, [0.0, 1.0, 0.7, 1.3], [0, 0, 20, 0], [1.0, 1.0, 1.0, 0.8], [4321], [3, 4, 5, 6])
    assert_draws(sample(logits, *args), expected_draws(logits, *args))
    plain = (args[0], torch.zeros_like(args[1]), torch.ones_like(args[2]), *args[3:])
    assert_draws(sample(logits, *plain, filtering=False), expected_draws(logits, *plain))


def test_sample_greedy_and_top_k_one_are_argmax(device):
    generator = torch.Generator().manual_seed(2)
    logits = (torch.randn(4, 40, generator=generator) * 3).to(device)
    args = tensors(device, [0.0, 1.0, 5.0, 0.0], [0, 1, 1, 7], [1.0, 1.0, 0.3, 0.5], [3], [0, 1, 2, 3])
    assert torch.equal(sample(logits, *args).cpu(), logits.argmax(1).cpu())


def test_sample_greedy_ties_take_the_lowest_id(device):
    logits = torch.zeros(2, 40, device=device)
    logits[:, [9, 17, 33]] = 5.0
    args = tensors(device, [0.0, 0.0], [0, 0], [1.0, 1.0], [3], [0, 1])
    assert sample(logits, *args, filtering=False).tolist() == [9, 9]


def test_sample_filters_never_pick_excluded_tokens(device):
    """Many draws of one distribution with top-k 3 (rows 0..) and top-p 0.6 (rows 16..)."""
    M, V = 32, 12
    probabilities = torch.tensor([0.3, 0.02, 0.2, 0.05, 0.1, 0.15, 0.01, 0.04, 0.06, 0.03, 0.02, 0.02])
    logits = probabilities.log()[None, :].expand(M, V).contiguous().to(device)
    top_k = [3] * 16 + [0] * 16
    top_p = [1.0] * 16 + [0.6] * 16
    args = tensors(device, [1.0] * M, top_k, top_p, [99], list(range(M)))
    ids = sample(logits, *args).cpu()
    top3 = {0, 2, 5}  # 0.3, 0.2, 0.15
    nucleus = {0, 2, 5}  # 0.3 + 0.2 = 0.5 < 0.6 <= 0.65
    assert set(ids[:16].tolist()) <= top3 and set(ids[16:].tolist()) <= nucleus
    assert len(set(ids.tolist())) > 1
    assert_draws(ids, expected_draws(logits, *args))


def test_sample_distribution_chi_square(device):
    """160 draws (one per row, steps 0..159) from 5 tokens follow softmax(logits / T)."""
    M = 160
    probabilities = torch.tensor([0.4, 0.25, 0.15, 0.12, 0.08])
    temperature = 0.5
    logits = (probabilities.log() * temperature)[None, :].expand(M, 5).contiguous().to(device)
    args = tensors(device, [temperature] * M, [0] * M, [1.0] * M, [2024], list(range(M)))
    ids = sample(logits, *args, filtering=False).cpu()
    counts = torch.bincount(ids, minlength=5).double()
    expected = probabilities.double() * M
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 33.4  # chi-square, 4 degrees of freedom, P(X > 33.4) = 1e-6


@triton.jit
def _noise_argmax_kernel(logits_ptr, noise_ptr, ids_ptr, V, seed, DRAWS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Draw d: argmax over tokens of logits + gumbel_noise(seed, step=d, stream=0, token)."""
    draws = tl.arange(0, DRAWS)
    tokens = tl.arange(0, BLOCK_V)
    noise = gumbel_noise(seed, draws[:, None], draws[:, None] * 0, tokens[None, :])
    mask = (tokens < V)[None, :] & (draws >= 0)[:, None]
    tl.store(noise_ptr + draws[:, None] * BLOCK_V + tokens[None, :], noise, mask=mask)
    logits = tl.load(logits_ptr + tokens, mask=tokens < V, other=float("-inf"))
    score = tl.where(mask, logits[None, :] + noise, float("-inf"))
    tl.store(ids_ptr + draws, tl.argmax(score, axis=1))


def test_gumbel_noise_is_gumbel_and_argmax_follows_softmax(device):
    """4096 draws of 8 tokens in one program: the noise's moments, the reference, and the Gumbel-max law."""
    draws, V = 4096, 8
    probabilities = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    logits = probabilities.log().to(device)
    noise = torch.empty(draws, V, device=device)
    ids = torch.zeros(draws, dtype=torch.int32, device=device)
    _noise_argmax_kernel[(1,)](logits, noise, ids, V, 31337, DRAWS=draws, BLOCK_V=V)
    reference = gumbel_noise_reference(31337, torch.arange(draws)[:, None], 0, torch.arange(V)[None, :])
    torch.testing.assert_close(noise.cpu(), reference, rtol=1e-5, atol=1e-5)
    samples = noise.double().flatten()
    assert abs(samples.mean().item() - 0.5772157) < 0.03  # Euler's gamma, 4 sigma of 32768 draws
    assert abs(samples.var().item() - torch.pi ** 2 / 6) < 0.08
    counts = torch.bincount(ids.long().cpu(), minlength=V).double()
    expected = probabilities.double() * draws
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 40.5  # chi-square, 7 degrees of freedom, P(X > 40.5) = 1e-6


def test_sample_reproducible_and_steps_differ(device):
    M = 8
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(M, 40, generator=generator).to(device) * 0.3  # flat: draws vary with the step
    args = tensors(device, [1.0] * M, [0] * M, [1.0] * M, [5], [10] * M)
    first = sample(logits, *args, filtering=False)
    assert torch.equal(first, sample(logits, *args, filtering=False))
    assert torch.equal(first, sample(logits, *args))  # the search passes leave unfiltered rows alone
    later = tensors(device, [1.0] * M, [0] * M, [1.0] * M, [5], [11] * M)
    assert not torch.equal(first, sample(logits, *later, filtering=False))
    out = torch.empty(M, dtype=torch.int64, device=device)
    assert sample(logits, *args, out=out, filtering=False) is out and torch.equal(out, first)


@pytest.mark.parametrize("change, message", [
    (dict(logits=torch.zeros(3, 40, dtype=torch.float16)), "logits has dtype"),
    (dict(temperature=torch.ones(2)), "temperature has shape"),
    (dict(top_k=torch.zeros(3, dtype=torch.int64)), "top_k has dtype"),
    (dict(top_p=torch.ones(3, dtype=torch.float64)), "top_p has dtype"),
    (dict(seed=torch.zeros(2, dtype=torch.int64)), "seed has shape"),
    (dict(seed=torch.zeros(1, dtype=torch.int32)), "seed has dtype"),
    (dict(step=torch.zeros(3, dtype=torch.int32)), "step has dtype"),
    (dict(out=torch.zeros(3, dtype=torch.int32)), "out has dtype"),
    (dict(logits=torch.zeros(3, 0)), "logits has 0 columns"),
])
def test_sample_rejects_bad_arguments(change, message):
    args = dict(logits=torch.zeros(3, 40), temperature=torch.ones(3), top_k=torch.zeros(3, dtype=torch.int32),
                top_p=torch.ones(3), seed=torch.zeros(1, dtype=torch.int64), step=torch.zeros(3, dtype=torch.int64))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        sample(**args)


# ---- GPU: the real vocabulary (248320) --------------------------------------------------------------------

VOCAB = 248320


@pytest.mark.gpu
@pytest.mark.parametrize("per_row_seed", [False, True])
def test_gpu_sample_matches_gumbel_max(per_row_seed):
    torch.manual_seed(5)
    M = len(SETTINGS) + 2
    settings = SETTINGS + [(0.8, 50, 0.9), (1.0, 1000, 0.99)]
    logits = torch.randn(M, VOCAB, device="cuda") * 4
    temperature, top_k, top_p = zip(*settings)
    seed = [11 * row for row in range(M)] if per_row_seed else [777]
    args = tensors("cuda", temperature, top_k, top_p, seed, [3 + row for row in range(M)])
    ids = sample(logits, *args)
    assert_draws(ids, expected_draws(logits, *args))
    assert torch.equal(ids, sample(logits, *args))


@pytest.mark.gpu
def test_gpu_sample_cuda_graph():
    """Captured once; each replay draws at the step the device holds, which the graph advances."""
    torch.manual_seed(6)
    logits = torch.randn(1, VOCAB, device="cuda") * 4
    temperature, top_k, top_p, seed, step = tensors("cuda", [0.9], [40], [0.9], [1], [0])
    out = torch.empty(1, dtype=torch.int64, device="cuda")
    sample(logits, temperature, top_k, top_p, seed, step, out)  # warm-up: workspace
    expected = [int(sample(logits, temperature, top_k, top_p, seed, torch.tensor([s], device="cuda")))
                for s in range(4)]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sample(logits, temperature, top_k, top_p, seed, step, out)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        sample(logits, temperature, top_k, top_p, seed, step, out)
        step.add_(1)
    step.zero_()
    drawn = []
    for _ in range(4):
        graph.replay()
        drawn.append(int(out))
    assert drawn == expected


@pytest.mark.gpu
def test_gpu_benchmark_cases_run():
    for case in benchmark_cases():
        case["fn"]()
    torch.cuda.synchronize()


# ---- feedback: a step's ids become the next step's inputs --------------------------------------------

@pytest.mark.parametrize("rows", [1, 3, 5])
def test_feed_back_makes_the_chosen_ids_the_next_inputs(device, rows):
    from qwen_triton.operators.sampling import feed_back

    generator = torch.Generator().manual_seed(rows)
    chosen = torch.randint(0, 248_320, (rows,), generator=generator)
    positions = torch.randint(0, 40, (rows,), generator=generator).int()
    positions[0] = 49  # at max_position: stays
    steps = torch.randint(0, 9, (rows,), generator=generator)
    token_ids = torch.full((rows,), -1, dtype=torch.int64)
    lengths = torch.zeros(rows, dtype=torch.int32)
    on_device = [t.to(device, copy=True) for t in (chosen, token_ids, positions, lengths, steps)]
    host_ids = torch.full((2, rows), -1, dtype=torch.int64, pin_memory=device == "cuda")
    if device == "cpu":
        host_ids = host_ids.to(device)
    feed_back(*on_device, max_position=49, host_ids=host_ids)
    if device == "cuda":
        torch.cuda.synchronize()
    # each row's id in the host row of its step's parity, the other row untouched
    for row in range(rows):
        parity = int(steps[row]) % 2
        assert host_ids[parity, row] == chosen[row] and host_ids[1 - parity, row] == -1
    expected_positions = torch.clamp(positions + 1, max=49)
    assert torch.equal(on_device[1].cpu(), chosen)
    assert torch.equal(on_device[2].cpu(), expected_positions)
    assert torch.equal(on_device[3].cpu(), expected_positions + 1)
    assert torch.equal(on_device[4].cpu(), steps + 1)
    assert torch.equal(on_device[0].cpu(), chosen)  # the chosen ids are left as they are


@pytest.mark.parametrize("name, tensor, message", [
    ("chosen", torch.zeros(2, dtype=torch.int32), "chosen has dtype"),
    ("positions", torch.zeros(2, dtype=torch.int64), "positions has dtype"),
    ("lengths", torch.zeros(3, dtype=torch.int32), r"lengths has shape \[3\]"),
    ("steps", torch.zeros(4, dtype=torch.int64)[::2], "steps must be contiguous"),
])
def test_feed_back_rejects_bad_arguments(name, tensor, message):
    from qwen_triton.operators.sampling import feed_back

    arguments = dict(chosen=torch.zeros(2, dtype=torch.int64), token_ids=torch.zeros(2, dtype=torch.int64),
                     positions=torch.zeros(2, dtype=torch.int32), lengths=torch.zeros(2, dtype=torch.int32),
                     steps=torch.zeros(2, dtype=torch.int64))
    arguments[name] = tensor
    with pytest.raises(ValueError, match=message):
        feed_back(**arguments, max_position=10)


def test_feed_back_rejects_a_bad_host_buffer():
    from qwen_triton.operators.sampling import feed_back

    arguments = dict(chosen=torch.zeros(2, dtype=torch.int64), token_ids=torch.zeros(2, dtype=torch.int64),
                     positions=torch.zeros(2, dtype=torch.int32), lengths=torch.zeros(2, dtype=torch.int32),
                     steps=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"host_ids has shape \[2, 3\]"):
        feed_back(**arguments, max_position=10, host_ids=torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="host_ids has dtype"):
        feed_back(**arguments, max_position=10, host_ids=torch.zeros(2, 2, dtype=torch.int32))


@pytest.mark.gpu
def test_gpu_feed_back_needs_pinned_host_ids():
    from qwen_triton.operators.sampling import feed_back

    arguments = {name: torch.zeros(2, dtype=dtype, device="cuda") for name, dtype in (
        ("chosen", torch.int64), ("token_ids", torch.int64), ("positions", torch.int32), ("lengths", torch.int32),
        ("steps", torch.int64))}
    for host_ids in (torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64, device="cuda")):
        with pytest.raises(ValueError, match="pinned host memory"):
            feed_back(**arguments, max_position=10, host_ids=host_ids)


# ---- min-p: a threshold at max(s) + ln(min_p), found with the row's max -------------------------------------

def kernel_kept(logits, temperature):
    """The tokens the last `sample` call kept per row: its draw threshold (the key of the workspace's LO) applied
    to s = logits / T."""
    from qwen_triton.operators.sampling.sample import LO, _workspace

    M, V = logits.shape
    threshold = _workspace(logits.device, M, V)["state_int"][:, int(LO.value)].cpu()
    scaled = logits.float().cpu() / temperature.cpu()[:, None]
    bits = scaled.contiguous().view(torch.int32).long()
    bits = torch.where(bits == -2**31, 0, bits)  # -0.0: +0.0's key
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) >= threshold[:, None]


# (temperature, top_k, top_p, min_p) per row: min-p alone, with top-k, with top-p, with both, off, min_p 1 (the
# max and its ties), a min-p looser than top-k, greedy with min-p
MIN_P_SETTINGS = [(1.0, 0, 1.0, 0.1), (0.7, 8, 1.0, 0.05), (1.3, 0, 0.8, 0.05), (1.0, 10, 0.7, 0.2),
                  (1.0, 0, 1.0, 0.0), (0.5, 0, 1.0, 1.0), (1.0, 3, 1.0, 0.001), (0.0, 0, 1.0, 0.5)]


@pytest.mark.parametrize("filtering", [True, False])
def test_min_p_keeps_the_reference_set_and_draws_from_it(device, filtering):
    settings = MIN_P_SETTINGS if filtering else [row for row in MIN_P_SETTINGS if row[1] == 0 and row[2] == 1.0]
    M, V = len(settings), 40
    generator = torch.Generator().manual_seed(8)
    logits = (torch.randn(M, V + 2, generator=generator) * 1.5).to(device)[:, 2:]  # strided rows
    logits[:, 7] = logits.max(dim=1).values  # a tie at the max: min_p 1.0 keeps both
    temperature, top_k, top_p, min_p = zip(*settings)
    args = tensors(device, temperature, top_k, top_p, [77], [5 + row for row in range(M)])
    min_p = torch.tensor(min_p, dtype=torch.float32, device=device)
    ids = sample(logits, *args, filtering=filtering, min_p=min_p)
    kept = kernel_kept(logits, args[0])
    for row, (t, k, p, m) in enumerate(settings):
        if t == 0.0:
            continue
        expected = filtered_probabilities(logits[row].cpu(), SamplingParams(t, k, p, min_p=m)) > 0
        assert torch.equal(kept[row], expected), f"row {row} {settings[row]}"
    assert 1 < int(kept[0].sum()) < V  # min-p alone cut some tokens and kept several
    assert int(kept[settings.index((0.5, 0, 1.0, 1.0))].sum()) == 2
    assert_draws(ids, expected_draws(logits, *args, min_p=min_p))


def test_min_p_draws_reproducible_by_seed(device):
    M, V = 8, 40
    logits = (torch.randn(M, V, generator=torch.Generator().manual_seed(9)) * 0.5).to(device)
    min_p = torch.full((M,), 0.3, device=device)

    def draw(seed):
        args = tensors(device, [1.0] * M, [0] * M, [1.0] * M, [seed], list(range(M)))
        return sample(logits, *args, filtering=False, min_p=min_p)

    assert torch.equal(draw(21), draw(21))
    assert not torch.equal(draw(21), draw(22))


def test_min_p_long_row(device):
    """A row past the interpreter's INTERPRETER_WIDE_V (its wide tiles)."""
    M, V = 3, 5000
    logits = (torch.randn(M, V, generator=torch.Generator().manual_seed(10)) * 2).to(device)
    args = tensors(device, [1.0, 0.8, 1.2], [0, 30, 0], [1.0, 1.0, 0.9], [4], [1, 2, 3])
    min_p = torch.tensor([0.05, 0.01, 0.02], device=device)
    ids = sample(logits, *args, min_p=min_p)
    kept = kernel_kept(logits, args[0])
    for row in range(M):
        params = SamplingParams(float(args[0][row]), int(args[1][row]), float(args[2][row]), min_p=float(min_p[row]))
        assert torch.equal(kept[row], filtered_probabilities(logits[row].cpu(), params) > 0)
    assert_draws(ids, expected_draws(logits, *args, min_p=min_p))


# ---- penalties: repetition, frequency, presence on the logits, in place --------------------------------------

# (repetition, frequency, presence) per row: off, each alone, all three, below 1, negative ones, off again
PENALTY_SETTINGS = [(1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 1.5), (2.0, 1.0, -1.0),
                    (0.7, 0.0, 0.0), (1.0, -0.4, -2.0), (1.0, 0.0, 0.0)]


def penalty_case(device, M, V, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(M, V, generator=generator) * 3
    logits[:, 0] = -0.0  # signed zero, kept as it is
    counts = torch.randint(0, 4, (M, V), generator=generator, dtype=torch.int32)
    counts *= (torch.rand(M, V, generator=generator) < 0.3).int()
    prompt_mask = torch.rand(M, V, generator=generator) < 0.2
    return logits.to(device), counts.to(device), prompt_mask.to(device)


@pytest.mark.parametrize("V", [40, 5000])
def test_penalties_match_the_reference(device, V):
    M = len(PENALTY_SETTINGS)
    logits, counts, prompt_mask = penalty_case(device, M, V, seed=V)
    wide = torch.full((M, V + 5), float("nan"), device=device)
    penalised = wide[:, 3:V + 3]  # strided rows
    penalised.copy_(logits)
    repetition, frequency, presence = (torch.tensor(column, dtype=torch.float32, device=device)
                                       for column in zip(*PENALTY_SETTINGS))
    assert apply_penalties(penalised, counts, prompt_mask, repetition, frequency, presence) is penalised
    for row, (r, f, p) in enumerate(PENALTY_SETTINGS):
        params = SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
        expected = penalize(logits[row].cpu(), params, counts[row].cpu(), prompt_mask[row].cpu())
        torch.testing.assert_close(penalised[row].cpu(), expected, rtol=1e-6, atol=1e-6)
        touched = prompt_mask[row].cpu() | (counts[row].cpu() > 0)
        assert torch.equal(penalised[row].cpu()[~touched], logits[row].cpu()[~touched])  # untouched tokens
    for row in (0, M - 1):  # everything off: bit for bit, signed zero included
        assert torch.equal(penalised[row].cpu().view(torch.int32), logits[row].cpu().view(torch.int32))
    assert torch.isnan(wide[:, :3]).all() and torch.isnan(wide[:, V + 3:]).all()  # nothing outside the rows
    assert not torch.equal(penalised[4].cpu(), logits[4].cpu())


def test_penalised_draws_match_the_reference_sampler(device):
    """Penalties, then temperature / top-k / top-p / min-p: the draws are the argmax over the reference's kept
    set of the penalised logits / T + G; greedy rows the argmax of the penalised logits."""
    M, V = len(PENALTY_SETTINGS), 40
    logits, counts, prompt_mask = penalty_case(device, M, V, seed=3)
    repetition, frequency, presence = (torch.tensor(column, dtype=torch.float32, device=device)
                                       for column in zip(*PENALTY_SETTINGS))
    penalised = apply_penalties(logits.clone(), counts, prompt_mask, repetition, frequency, presence)
    args = tensors(device, [0.0, 1.0, 0.8, 0.0, 1.2, 1.0, 0.9, 1.0], [0, 5, 0, 0, 0, 10, 0, 0],
                   [1.0, 1.0, 0.9, 1.0, 1.0, 0.8, 1.0, 1.0], [6], list(range(M)))
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.1, 0.0, 0.0, 0.0], device=device)
    ids = sample(penalised, *args, min_p=min_p)
    expected = torch.stack([penalize(logits[row].cpu(), SamplingParams(repetition_penalty=r, frequency_penalty=f,
                                                                         presence_penalty=p),
                                     counts[row].cpu(), prompt_mask[row].cpu())
                            for row, (r, f, p) in enumerate(PENALTY_SETTINGS)])
    assert_draws(ids, expected_draws(expected, *args, min_p=min_p))
    for row in (0, 3):
        assert int(ids[row]) == int(expected[row].argmax())


def test_penalties_and_counts_over_slots(device):
    """Row r reads the history of slot slots[r] (slots [3, 1] of 5, and a padding row of slot -1 with penalties
    on): each row as its slot's history alone gives it, the padding row's logits untouched; count_tokens counts
    each row's id in its slot's row and nothing for the padding row."""
    V = 40
    logits, counts, prompt_mask = penalty_case(device, 5, V, seed=8)
    logits = logits[:3].clone()
    slots = torch.tensor([3, 1, -1], device=device, dtype=torch.int32)
    repetition, frequency, presence = (torch.tensor(column, dtype=torch.float32, device=device)
                                       for column in zip(*[(1.3, 0.5, 0.0), (2.0, 1.0, -1.0), (1.5, 0.5, 1.0)]))
    penalised = apply_penalties(logits.clone(), counts, prompt_mask, repetition, frequency, presence, slots=slots)
    for row, slot in enumerate([3, 1]):
        alone = apply_penalties(logits[row:row + 1].clone(), counts[slot:slot + 1], prompt_mask[slot:slot + 1],
                                repetition[row:row + 1], frequency[row:row + 1], presence[row:row + 1])
        assert torch.equal(penalised[row], alone[0])
        assert not torch.equal(penalised[row], logits[row])
    assert torch.equal(penalised[2], logits[2])
    chosen = torch.tensor([5, 7, 9], device=device)
    expected = counts.clone()
    expected[3, 5] += 1
    expected[1, 7] += 1
    assert count_tokens(chosen, counts, slots=slots) is counts
    assert torch.equal(counts, expected)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_count_tokens_counts_each_rows_chosen_id(device, rows):
    V = 40
    counts = torch.randint(0, 3, (rows, V), generator=torch.Generator().manual_seed(rows), dtype=torch.int32)
    chosen = torch.tensor([(7 * row + 3) % V for row in range(rows)], dtype=torch.int64)
    expected = counts.clone()
    expected[torch.arange(rows), chosen] += 2
    on_device = counts.to(device)
    count_tokens(chosen.to(device), on_device)
    assert count_tokens(chosen.to(device), on_device) is on_device
    assert torch.equal(on_device.cpu(), expected)


@pytest.mark.parametrize("change, message", [
    (dict(logits=torch.zeros(3, 40, dtype=torch.float16)), "logits has dtype"),
    (dict(counts=torch.zeros(3, 40, dtype=torch.int64)), "counts has dtype"),
    (dict(counts=torch.zeros(2, 40, dtype=torch.int32)), "counts has shape"),
    (dict(prompt_mask=torch.zeros(3, 40, dtype=torch.int8)), "prompt_mask has dtype"),
    (dict(repetition=torch.ones(3, dtype=torch.float64)), "repetition has dtype"),
    (dict(frequency=torch.zeros(4)), "frequency has shape"),
    (dict(presence=torch.zeros(3, 1)), "presence has shape"),
    (dict(logits=torch.zeros(40, 3).t()), "logits must have unit stride"),
])
def test_apply_penalties_rejects_bad_arguments(change, message):
    args = dict(logits=torch.zeros(3, 40), counts=torch.zeros(3, 40, dtype=torch.int32),
                prompt_mask=torch.zeros(3, 40, dtype=torch.bool), repetition=torch.ones(3), frequency=torch.zeros(3),
                presence=torch.zeros(3))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        apply_penalties(**args)


def test_count_tokens_and_min_p_reject_bad_arguments():
    with pytest.raises(ValueError, match="chosen has dtype"):
        count_tokens(torch.zeros(2, dtype=torch.int32), torch.zeros(2, 40, dtype=torch.int32))
    with pytest.raises(ValueError, match="counts has shape"):
        count_tokens(torch.zeros(2, dtype=torch.int64), torch.zeros(1, 40, dtype=torch.int32))
    with pytest.raises(ValueError, match="counts has dtype"):
        count_tokens(torch.zeros(2, dtype=torch.int64), torch.zeros(2, 40))
    args = tensors("cpu", [1.0] * 3, [0] * 3, [1.0] * 3, [0], [0] * 3)
    with pytest.raises(ValueError, match="min_p has shape"):
        sample(torch.zeros(3, 40), *args, min_p=torch.zeros(2))
    with pytest.raises(ValueError, match="min_p has dtype"):
        sample(torch.zeros(3, 40), *args, min_p=torch.zeros(3, dtype=torch.float64))


@pytest.mark.gpu
def test_gpu_penalties_and_min_p_at_the_real_vocabulary():
    M = len(PENALTY_SETTINGS)
    logits, counts, prompt_mask = penalty_case("cuda", M, VOCAB, seed=12)
    repetition, frequency, presence = (torch.tensor(column, dtype=torch.float32, device="cuda")
                                       for column in zip(*PENALTY_SETTINGS))
    penalised = apply_penalties(logits.clone(), counts, prompt_mask, repetition, frequency, presence)
    for row, (r, f, p) in enumerate(PENALTY_SETTINGS):
        params = SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
        torch.testing.assert_close(penalised[row], penalize(logits[row], params, counts[row], prompt_mask[row]),
                                   rtol=1e-6, atol=1e-6)
    args = tensors("cuda", [1.0] * M, [0, 50, 0, 0, 100, 0, 0, 20], [1.0, 1.0, 0.9, 1.0, 0.95, 1.0, 1.0, 1.0],
                   [31], list(range(M)))
    min_p = torch.tensor([0.05, 0.1, 0.02, 0.0, 0.01, 0.2, 0.3, 0.0], device="cuda")
    ids = sample(penalised, *args, min_p=min_p)
    assert_draws(ids, expected_draws(penalised, *args, min_p=min_p))
    assert torch.equal(ids, sample(penalised, *args, min_p=min_p))


# ---- the top-k candidates (top_k_bound): the search's thresholds and ids in two launches ---------------------

def state_of_last_call(logits):
    """(the draw thresholds, the phases) the last `sample` call left in its workspace, per row."""
    from qwen_triton.operators.sampling.sample import LO, PHASE, _workspace

    state = _workspace(logits.device, *logits.shape)["state_int"]
    return state[:, int(LO.value)].cpu().clone(), state[:, int(PHASE.value)].cpu().clone()


def assert_candidates_choose_as_the_search(logits, args, bound, min_p=None, reference=True):
    """The same ids, and for the sampled rows the same draw threshold (the kept set), by both paths; with
    reference, the draws are also the reference sampler's (not for rows with ties: it keeps some of the tokens tied
    at top-p's boundary, in its sort's order, the kernels all of them). Returns the top-k path's phases (DRAWN, or
    DONE where the draw kernel drew)."""
    searched = sample(logits, *args, min_p=min_p)
    threshold, _ = state_of_last_call(logits)
    chosen = sample(logits, *args, min_p=min_p, top_k_bound=bound)
    candidate_threshold, phase = state_of_last_call(logits)
    assert torch.equal(chosen, searched), f"{chosen.tolist()} != {searched.tolist()}"
    sampled = args[0].cpu() > 0
    assert torch.equal(candidate_threshold[sampled], threshold[sampled])
    if reference:
        assert_draws(chosen, expected_draws(logits, *args, min_p=min_p))
    return phase


def candidate_rows(device, kind, V, bound, per_row_seed, seed, rows=16):
    """rows (8 settings, repeated at later steps) with 0 < top_k <= bound (bound >= 3): greedy (any top_k), top-k
    alone, with top-p, with min-p, top_k 1, top_k = bound; normal logits, or rounded to integers (ties at the k-th,
    some beyond a chunk's slots), or coarse (5 values: most tokens tied)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=generator) * 2
    if kind == "rounded":
        logits = logits.round()
    elif kind == "coarse":
        logits = (logits / 2).round().clamp(-2, 2)
    qwen = min(20, bound)
    settings = [(0.0, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (0.7, qwen, 0.8, 0.0), (1.0, qwen, 0.95, 0.0),
                (1.3, 2, 0.5, 0.05), (0.5, 1, 1.0, 0.0), (1.0, bound, 0.9, 0.2), (2.0, max(1, bound // 2), 0.3, 0.0)]
    settings = (settings * (rows // 8 + 1))[:rows]
    temperature, top_k, top_p, min_p = zip(*settings)
    seeds = [seed * 100 + row for row in range(rows)] if per_row_seed else [seed]
    args = tensors(device, temperature, top_k, top_p, seeds, [row // 8 + 10 * seed for row in range(rows)])
    return logits.to(device), args, torch.tensor(min_p, dtype=torch.float32, device=device)


@pytest.mark.parametrize("kind, V, bound, per_row_seed, seed", [
    ("normal", 40, 64, False, 1), ("normal", 40, 20, True, 2), ("normal", 40, 3, False, 3),
    ("rounded", 40, 16, False, 4), ("rounded", 40, 4, True, 5), ("coarse", 40, 8, False, 6),
    ("normal", 5000, 64, False, 7), ("coarse", 5000, 20, True, 8),
])
def test_top_k_candidates_choose_what_the_search_chooses(device, kind, V, bound, per_row_seed, seed):
    """Both paths over random rows and seeds (V = 40: 3 chunks of 16 under the interpreter; V = 5000: its wide
    tiles), normal rows and rows with ties, with min-p and without: the same thresholds, the same ids."""
    logits, args, min_p = candidate_rows(device, kind, V, bound, per_row_seed, seed, rows=8 if V < 1000 else 4)
    assert_candidates_choose_as_the_search(logits, args, bound, min_p if seed % 2 else None, kind == "normal")


def test_top_k_candidates_ties_beyond_the_candidates(device):
    """Ties at the k-th largest value that no chunk's K slots hold: the top-k path counts them into top-p's mass and
    leaves the draw to the draw kernel when they are kept; not when top-p or min-p cuts above them."""
    from qwen_triton.operators.sampling.sample import DONE, DRAWN

    V = 40
    logits = torch.full((6, V), -1.0)
    logits[:, [3, 30]] = 4.0
    logits[:, 5:29] = 1.0  # 24 tokens tied at the 3rd largest value, across the chunks
    logits[5, 0], logits[5, 1] = -0.0, 0.0  # a greedy row: -0.0 ties +0.0, the lower id wins
    logits[5, 2:] = -5.0
    args = tensors(device, [1.0, 1.0, 1.0, 0.8, 1.0, 0.0], [3, 3, 4, 3, 3, 0], [1.0, 0.999, 0.6, 1.0, 1.0, 1.0], [7],
                   [0, 1, 2, 3, 4, 5])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.0], device=device)
    logits = logits.to(device)
    phase = assert_candidates_choose_as_the_search(logits, args, 4, min_p)
    # rows 0, 1, 3: the ties are kept (top-p 0.999 needs them): drawn by the draw kernel; row 2: top-p 0.6 keeps
    # the two 4.0s (0.63 of the mass); row 4: min-p 0.5 cuts below 4.0
    assert phase.tolist() == [DONE.value, DONE.value, DRAWN.value, DONE.value, DRAWN.value, DRAWN.value]
    assert int(sample(logits, *args, min_p=min_p, top_k_bound=4)[5]) == 0
    for step in range(2):  # other draws among the ties, the same by both paths
        args = (*args[:4], torch.full((6,), 10 + step, dtype=torch.int64, device=device))
        assert_candidates_choose_as_the_search(logits, args, 4, min_p)


def test_top_k_candidates_signed_zeros_tie(device):
    """-0.0 and +0.0 compare equal, as in the reference sampler: a top-k threshold at zero keeps both, by both
    paths, whichever zero the row's maximum is."""
    V = 40
    logits = torch.full((4, V), -3.0)
    logits[:, 4:12] = -0.0
    logits[:, 20:26] = 0.0
    logits[2:, 30] = 2.0  # rows 2, 3: the zeros are the 2nd largest value
    args = tensors(device, [1.0, 0.7, 1.0, 1.0], [1, 2, 2, 3], [1.0, 1.0, 0.99, 1.0], [11], [0, 1, 2, 3])
    logits = logits.to(device)
    for step in range(2):
        args = (*args[:4], torch.tensor([step * 4 + row for row in range(4)], device=device))
        assert_candidates_choose_as_the_search(logits, args, 4)
    kept = kernel_kept(logits, args[0])
    assert kept[:, 4:12].all() and kept[:, 20:26].all() and not kept[:, :4].any()


def test_top_k_candidates_launch_two_kernels(device, monkeypatch):
    """The top-k path's launch list: its kernel and the draw kernel, whatever the rows hold; the search path's 14."""
    module = importlib.import_module("qwen_triton.operators.sampling.sample")
    launched = []

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in ("_stats_kernel", "_search_kernel", "_top_k_kernel", "_draw_kernel"):
        monkeypatch.setattr(module, name, Counted(name, getattr(module, name)))
    logits, args, min_p = candidate_rows(device, "coarse", 40, 8, False, seed=3)
    sample(logits, *args, min_p=min_p, top_k_bound=8)
    assert launched == ["_top_k_kernel", "_draw_kernel"]
    launched.clear()
    sample(logits, *args, min_p=min_p)
    assert launched == ["_stats_kernel"] + ["_search_kernel"] * 12 + ["_draw_kernel"]


@pytest.mark.parametrize("change, message", [
    (dict(top_k_bound=0), "top_k_bound must be an int from 1 to 64"),
    (dict(top_k_bound=65), "top_k_bound must be an int from 1 to 64"),
    (dict(top_k_bound=2.0), "top_k_bound must be an int"),
    (dict(top_k_bound=20, filtering=False), "pass filtering=True"),
])
def test_top_k_bound_rejects_bad_values(change, message):
    args = tensors("cpu", [1.0] * 3, [5] * 3, [1.0] * 3, [0], [0] * 3)
    with pytest.raises(ValueError, match=message):
        sample(torch.zeros(3, 40), *args, **change)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_gpu_top_k_candidates_choose_what_the_search_chooses(rows):
    """The real vocabulary, the engine's width (K_MAX): Qwen's settings (0.7 / 0.8 / 20, 1.0 / 0.95 / 20), min-p,
    top_k 64, greedy; normal rows, rows of integers (a few ties), rows of 5 values (tens of thousands tied at the
    largest: every chunk takes the rounds, and the draw kernel draws); at several steps, replayed from a CUDA graph."""
    from qwen_triton.operators.sampling.sample import DONE, K_MAX

    torch.manual_seed(rows)
    settings = [(0.7, 20, 0.8, 0.0), (1.0, 20, 0.95, 0.0), (1.0, 20, 0.95, 0.05), (0.8, 64, 0.9, 0.0),
                (0.0, 0, 1.0, 0.0), (1.3, 1, 1.0, 0.0), (1.0, 40, 0.5, 0.01), (0.7, 20, 1.0, 0.0)]
    settings = (settings * 2)[:rows]
    temperature, top_k, top_p, min_p = zip(*settings)
    min_p = torch.tensor(min_p, device="cuda")
    logits = torch.randn(rows, VOCAB, device="cuda") * 4
    logits[1::4] = logits[1::4].round()
    logits[3::4] = (logits[3::4] / 4).round().clamp(-2, 2)
    for step in range(4):  # (the search's draws are the reference's: test_gpu_sample_matches_gumbel_max)
        args = tensors("cuda", temperature, top_k, top_p, [99], [step * rows + row for row in range(rows)])
        phase = assert_candidates_choose_as_the_search(logits, args, K_MAX, min_p, reference=False)
        assert (phase[3::4] == DONE.value).all()
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    step = args[4].clone()
    expected = [sample(logits, *args[:4], step + i, min_p=min_p, top_k_bound=K_MAX).clone() for i in range(3)]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sample(logits, *args[:4], step, out, min_p=min_p, top_k_bound=K_MAX)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        sample(logits, *args[:4], step, out, min_p=min_p, top_k_bound=K_MAX)
        step.add_(1)
    step.copy_(args[4])
    for i in range(3):
        graph.replay()
        assert torch.equal(out, expected[i])
