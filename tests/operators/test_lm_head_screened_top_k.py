"""Top-k sampling's LM head through the int8 screen (lm_head/screened_top_k.py): logits exact at every token the
top k can hold, the penalties applied to them, bounds elsewhere.

What must hold: every written value is at least the token's exact (penalised) logit (a bound, or the logit); every
group maximum is at most the exact logits of its group's unpenalised tokens (the lower bounds hold); every token of
the true top k of the penalised logits / T (float64 here) carries its exact logit, and every other written value
lies below the row's k-th; so sample(..., top_k_bound=K_MAX) chooses from them the ids it chooses from the full
head's logits (lm_head_logits, then apply_penalties): over many seeds, in mixed batches (greedy rows, rows of
different top_k, top-p and min-p, penalised rows with positive and negative penalties and repetition above and
below 1, padding rows of slot -1), with ties, and with every logit equal (every token a candidate). CPU
(interpreter): float32 and float16 heads of 100 to 5000 tokens, up to 17 rows (two groups of the screen's 16); the
kernels compiled for sm_90 without spills. GPU: the 0.8B's head (248320 x 1024, bf16, random weights) at 1 and 16
rows at Qwen's four settings, and a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from qwen_triton.engine.sampling import SamplingParams, penalize
from qwen_triton.operators.lm_head import lm_head_logits
from qwen_triton.operators.lm_head import screened_top_k
from qwen_triton.operators.lm_head.screened import build_screen
from qwen_triton.operators.lm_head.screened_top_k import lm_head_screened_top_k, top_k_candidate_counts
from qwen_triton.operators.sampling import K_MAX, apply_penalties, sample
from tests.operators.test_lm_head import EPS, make
from tests.support import run_without_interpreter

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# (repetition, frequency, presence): off, each alone, all three, repetition below 1, negative ones
PENALTIES = [(1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 1.5), (2.0, 1.0, -1.0), (0.7, 0.0, 0.0),
             (1.0, -0.4, -2.0)]
# (temperature, top_k, top_p, min_p): Qwen's two settings, greedy (any top_k), top-k alone, top_k 1, min-p, K_MAX
SETTINGS = [(0.7, 20, 0.8, 0.0), (1.0, 20, 0.95, 0.0), (0.0, 0, 1.0, 0.0), (1.3, 3, 1.0, 0.0), (0.5, 1, 1.0, 0.0),
            (1.0, 8, 0.9, 0.1), (0.0, 77, 1.0, 0.0), (2.0, 5, 0.3, 0.0)]


def batch(device, M, V, K, dtype, seed, penalised=True, slots=None, history=20):
    """x, weight, the sampling tensors and the penalties' inputs of an M-row step (row r: SETTINGS and PENALTIES
    in turn, its history at slots[r] of `history` slots)."""
    generator = torch.Generator().manual_seed(seed)
    x = make((M, K), dtype, device, seed=seed)
    weight = make((V, K), dtype, device, seed=seed + 1, scale=0.5)
    settings = [SETTINGS[(row + seed) % len(SETTINGS)] for row in range(M)]
    temperature, top_k, top_p, min_p = (torch.tensor(column, device=device) for column in zip(*settings))
    sampling = dict(temperature=temperature.float(), top_k=top_k.int(), top_p=top_p.float(), min_p=min_p.float(),
                    seed=torch.tensor([seed], device=device), step=torch.arange(M, device=device) + seed)
    penalties = {}
    if penalised:
        counts = torch.randint(0, 4, (history, V), generator=generator, dtype=torch.int32)
        counts *= (torch.rand(history, V, generator=generator) < 0.02).int()
        prompt_mask = torch.rand(history, V, generator=generator) < 0.02
        repetition, frequency, presence = (torch.tensor(column, device=device) for column in
                                           zip(*[PENALTIES[(row + seed) % len(PENALTIES)] for row in range(M)]))
        penalties = dict(counts=counts.to(device), prompt_mask=prompt_mask.to(device), repetition=repetition.float(),
                         frequency=frequency.float(), presence=presence.float(),
                         slots=None if slots is None else torch.tensor(slots, dtype=torch.int32, device=device))
    return x, weight, sampling, penalties


def full_logits(x, weight, penalties, norm_weight=None):
    """The logits path of today's top-k modes: lm_head_logits, then apply_penalties."""
    logits = lm_head_logits(x, weight, norm_weight=norm_weight, eps=EPS)
    if penalties:
        apply_penalties(logits, **penalties)
    return logits


def screened(x, weight, sampling, penalties, norm_weight=None, top_k_bound=K_MAX):
    logits = torch.full((x.shape[0], weight.shape[0]), float("nan"), device=x.device)
    out = lm_head_screened_top_k(x, weight, build_screen(weight), logits, sampling["temperature"], sampling["top_k"],
                                 top_k_bound=top_k_bound, norm_weight=norm_weight, eps=EPS, **penalties)
    assert out is logits
    return logits


def draw(logits, sampling, min_p=True, top_k_bound=K_MAX):
    return sample(logits, sampling["temperature"], sampling["top_k"], sampling["top_p"], sampling["seed"],
                  sampling["step"], min_p=sampling["min_p"] if min_p else None, top_k_bound=top_k_bound)


def reference_penalised(x, weight, penalties, rows):
    """float64 exact logits of the x_n the last call formed (its workspace), penalised by the engine's penalize."""
    M, K = x.shape
    normed = screened_top_k._workspaces[(x.device, M, weight.shape[0], K)].normed
    exact = (normed.double() @ weight.double().T).cpu()
    if not penalties:
        return exact, exact
    penalised = exact.clone()
    slots = penalties["slots"]
    for row in range(rows):
        slot = row if slots is None else int(slots[row])
        if slot < 0:
            continue
        params = SamplingParams(repetition_penalty=float(penalties["repetition"][row]),
                                frequency_penalty=float(penalties["frequency"][row]),
                                presence_penalty=float(penalties["presence"][row]))
        penalised[row] = penalize(exact[row], params, penalties["counts"][slot].cpu(),
                                  penalties["prompt_mask"][slot].cpu()).double()
    return exact, penalised


def assert_top_k_exact(logits, exact, penalised, sampling, penalties):
    """The module's promise, row by row, against float64: every written value at least the exact (penalised) logit
    (within float32 rounding); every token whose penalised logit / T reaches the k-th largest (with a float32 margin)
    written exactly; every token written inexactly below the row's k-th written value."""
    logits = logits.double().cpu()
    M, V = logits.shape
    scale = exact.abs().max().item()
    close = (logits - penalised).abs() <= 1e-5 * scale
    assert (logits >= penalised - 1e-5 * scale).all(), "a written value below its exact logit"
    for row in range(M):
        temperature = float(sampling["temperature"][row])
        k = min(max(int(sampling["top_k"][row]), 1), K_MAX, V) if temperature > 0 else 1
        values = penalised[row] / (temperature if temperature > 0 else 1.0)
        kth = values.topk(k).values[-1]
        top = values >= kth - 1e-6 * scale  # (float32's roundings of the k-th and of tokens tied with it)
        assert close[row][top].all(), f"row {row}: a token of the top {k} not written exactly"
        written_kth = logits[row].topk(k).values[-1]
        assert (logits[row][~close[row]] < written_kth).all(), f"row {row}: a bound at or above the k-th"


def assert_bounds(x, weight, exact, penalties):
    """The group maxima of the lower bounds (the screen's) at most the exact logits of their groups' untouched
    tokens."""
    M, K = x.shape
    work = screened_top_k._workspaces[(x.device, M, weight.shape[0], K)]
    V = weight.shape[0]
    group = screened_top_k.GROUP
    padded = torch.full((M, work.groups * group), float("-inf"), dtype=torch.float64)
    untouched = exact.clone()
    if penalties:
        slots = penalties["slots"]
        for row in range(M):
            slot = row if slots is None else int(slots[row])
            r, f, p = (float(penalties[name][row]) for name in ("repetition", "frequency", "presence"))
            if slot >= 0 and (r != 1.0 or f != 0.0 or p != 0.0):
                touched = penalties["counts"][slot].cpu() > 0
                if r != 1.0:
                    touched |= penalties["prompt_mask"][slot].cpu()
                untouched[row][touched] = float("-inf")
    padded[:, :V] = untouched
    group_exact = padded.view(M, work.groups, group).max(dim=2).values
    slack = 1e-6 * exact.abs().max().item()
    assert (work.maxima.double().cpu() <= group_exact + slack).all(), "a lower bound above its exact logit"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, V, K, norm, penalised", [(1, 1500, 64, True, True), (3, 2000, 48, False, True),
                                                      (2, 1200, 64, True, False), (2, 600, 5000, True, True)])
def test_the_top_k_is_exact_and_the_bounds_hold(device, dtype, M, V, K, norm, penalised):
    x, weight, sampling, penalties = batch(device, M, V, K, dtype, seed=M + V, penalised=penalised)
    norm_weight = make((K,), dtype, device, seed=5, scale=0.3) if norm else None
    logits = screened(x, weight, sampling, penalties, norm_weight)
    exact, penalised_exact = reference_penalised(x, weight, penalties, M)
    assert_top_k_exact(logits, exact, penalised_exact, sampling, penalties)
    assert_bounds(x, weight, exact, penalties)
    counts = top_k_candidate_counts(x, V)
    # far fewer than the vocabulary; at 5,000 columns fewer (the bound grows as K, random logits spread as sqrt(K))
    assert all(1 <= count <= (V // 3 if K <= 1024 else 3 * V // 4) for count in counts), counts
    assert torch.equal(draw(logits, sampling), draw(full_logits(x, weight, penalties, norm_weight), sampling))


@pytest.mark.parametrize("seed", range(4))
def test_the_draws_are_the_logits_paths_over_seeds_and_mixed_rows(device, seed):
    """17 rows (two groups of the screen's 16), each a different mix of SETTINGS and PENALTIES, a padding row (slot
    -1, with penalties set), histories at scattered slots; a per-row seed in odd seeds: the logits path's ids, step
    after step. (A head of 5000 tokens: the interpreter's wide tiles, a screen tile and a check program a row.)"""
    M, V, K = 17, 5000, 32
    slots = [(5 * row + seed) % 20 for row in range(M)]
    slots[3] = -1
    x, weight, sampling, penalties = batch(device, M, V, K, torch.float32, seed=seed, slots=slots)
    if seed % 2:
        sampling["seed"] = torch.arange(M, device=device) * 7 + seed
    logits = screened(x, weight, sampling, penalties)
    expected = full_logits(x, weight, penalties)
    for step in range(4):
        sampling["step"] = sampling["step"] + 1
        assert torch.equal(draw(logits, sampling, min_p=step != 1), draw(expected, sampling, min_p=step != 1))
    exact, penalised = reference_penalised(x, weight, penalties, M)
    assert_top_k_exact(logits, exact, penalised, sampling, penalties)


def test_a_row_does_not_depend_on_its_batch(device):
    """Each row of a 17-row call writes the top of its logits as it does alone (exactly, bit for bit), so draws the
    same id (a seed per row: its stream is its own)."""
    M, V, K = 17, 600, 32
    x, weight, sampling, penalties = batch(device, M, V, K, torch.float16, seed=9, history=M)
    sampling["seed"] = torch.arange(M, device=device) + 100
    together = screened(x, weight, sampling, penalties)
    ids = draw(together, sampling)
    for row in (0, 6, 16):
        pick = slice(row, row + 1)
        alone_sampling = {name: tensor[pick] for name, tensor in sampling.items()}
        alone_penalties = dict({name: penalties[name][pick] for name in ("repetition", "frequency", "presence")},
                               counts=penalties["counts"][pick], prompt_mask=penalties["prompt_mask"][pick], slots=None)
        alone = screened(x[pick], weight, alone_sampling, alone_penalties)
        assert int(draw(alone, alone_sampling)) == int(ids[row])
        k = min(int(sampling["top_k"][row]), K_MAX) if float(sampling["temperature"][row]) > 0 else 1
        top = together[row].topk(k).indices
        assert torch.equal(alone[0, top], together[row, top])


def test_ties_and_equal_logits(device):
    """Integer weights and x (exact logits in any order of summation): ties at the k-th and across rows, and a row
    where every logit is equal (every token a candidate): the logits path's ids, and the exact values."""
    M, V, K = 4, 600, 16
    generator = torch.Generator().manual_seed(3)
    weight = torch.randint(-2, 3, (V, K), generator=generator).float()
    weight[V // 2:] = weight[:V - V // 2]  # every logit twice
    x = torch.randint(-2, 3, (M, K), generator=generator).float()
    x[3] = 0.0  # every logit 0: all equal
    weight, x = weight.to(device), x.to(device)
    sampling = dict(temperature=torch.tensor([1.0, 0.0, 0.5, 1.0], device=device),
                    top_k=torch.tensor([4, 1, 20, 3], dtype=torch.int32, device=device),
                    top_p=torch.tensor([1.0, 1.0, 0.9, 0.5], device=device), min_p=torch.zeros(M, device=device),
                    seed=torch.tensor([11], device=device), step=torch.arange(M, device=device))
    logits = screened(x, weight, sampling, {})
    expected = x @ weight.T
    for step in range(4):
        sampling["step"] = sampling["step"] + M
        assert torch.equal(draw(logits, sampling), draw(expected, sampling))
    assert top_k_candidate_counts(x, V)[3] == V and torch.equal(logits[3], expected[3])
    assert int(draw(logits, sampling)[1]) == int(expected[1].argmax())  # the greedy row: the lowest tied id


def test_every_token_a_candidate_when_top_k_exceeds_the_groups(device):
    """top_k past the groups the maxima cover (a tiny head): tau is -inf, every token is computed exactly."""
    V, K = 100, 32
    x, weight, sampling, _ = batch(device, 1, V, K, torch.float32, seed=0, penalised=False)
    sampling["temperature"][0], sampling["top_k"][0] = 1.0, 64
    logits = screened(x, weight, sampling, {})
    assert top_k_candidate_counts(x, V) == [V]
    torch.testing.assert_close(logits, lm_head_logits(x, weight), rtol=1e-5, atol=1e-5)


def test_errors_name_the_argument(device):
    x, weight, sampling, penalties = batch(device, 2, 100, 32, torch.float32, seed=1)
    screen = build_screen(weight)
    logits = torch.empty(2, 100, device=device)
    args = (x, weight, screen, logits, sampling["temperature"], sampling["top_k"])

    def call(*changed, **options):
        lm_head_screened_top_k(*changed, **options)

    with pytest.raises(ValueError, match="logits has shape"):
        call(*args[:3], logits[:, :50], *args[4:])
    with pytest.raises(ValueError, match="logits has dtype"):
        call(*args[:3], logits.half(), *args[4:])
    with pytest.raises(ValueError, match="top_k has dtype"):
        call(*args[:5], sampling["top_k"].long())
    with pytest.raises(ValueError, match="temperature has shape"):
        call(*args[:4], sampling["temperature"][:1], args[5])
    with pytest.raises(ValueError, match="screen.quantized"):
        call(x, weight, build_screen(weight[:50]), *args[3:])
    with pytest.raises(ValueError, match="top_k_bound"):
        call(*args, top_k_bound=K_MAX + 1)
    with pytest.raises(ValueError, match="come together"):
        call(*args, counts=penalties["counts"])
    with pytest.raises(ValueError, match="slots"):
        call(*args, slots=torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="counts has shape"):
        call(*args, **dict(penalties, counts=penalties["counts"][:, :99]))
    with pytest.raises(ValueError, match="presence has shape"):
        call(*args, **dict(penalties, presence=penalties["presence"][:1]))
    with pytest.raises(ValueError, match="no call"):
        top_k_candidate_counts(torch.zeros(5, 32, device=device), 100)


COMPILE_FOR_HOPPER = """
import importlib, json, os, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
module = importlib.import_module("qwen_triton.operators.lm_head.screened_top_k")
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
types = {"quantized_ptr": "*i8", "quantized_x_ptr": "*i8", "slots_ptr": "*i32", "counts_ptr": "*i32",
         "prompt_ptr": "*u8", "top_k_ptr": "*i32", "candidates_ptr": "*i32", "w_ptr": "*bf16",
         "x_ptr": "*bf16", "norm_ptr": "*bf16", "index_ptr": "*i32", "eps": "fp32"}
aligned = ("K", "V", "stride_qv", "stride_lm", "stride_wv", "stride_cm", "stride_pm")  # as Triton specialises them

def stack(kernel, constants, warps, stages=1):
    signature = {name: "constexpr" if name in constants else types.get(name, "*fp32" if name.endswith("_ptr")
                 else "i32") for name in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if name.endswith("_ptr") or name in aligned}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    path = os.path.join(tempfile.mkdtemp(), "kernel.cubin")
    open(path, "wb").write(compiled.asm["cubin"])
    usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    return int(usage.split("STACK:")[1].split()[0])

screened = importlib.import_module("qwen_triton.operators.lm_head.screened")
stacks = {}
for single in (True, False):
    for penalties in (False, True):
        stacks[f"screen single={single} penalties={penalties}"] = stack(
            module._screen_top_k_kernel, dict(SINGLE=single, HAS_PENALTIES=penalties, HAS_SLOTS=True,
                                              BLOCK_V=screened.SCREEN_ROWS, BLOCK_K=screened.SCREEN_COLUMNS,
                                              GROUP=module.GROUP, USE_PDL=True),
            screened.SCREEN_WARPS, screened.SCREEN_STAGES)
stacks["threshold"] = stack(module._threshold_kernel, dict(WIDTH=64, BLOCK_G=2048, USE_PDL=True),
                            module.THRESHOLD_WARPS)
for block_x in (1024, 8192):  # the 0.8B's rows; the widest (the 27B's 5,120 columns), at its warps
    for penalties in (False, True):
        stacks[f"check penalties={penalties} columns={block_x}"] = stack(
            module._check_top_k_kernel, dict(HAS_PENALTIES=penalties, HAS_SLOTS=True, BLOCK_R=screened.CHECK_ROWS,
                                             BLOCK_X=block_x, USE_PDL=True), screened.row_warps(block_x))
    for norm in (False, True):
        stacks[f"quantize norm={norm} columns={block_x}"] = stack(
            screened._quantize_kernel, dict(HAS_NORM=norm, BLOCK_X=block_x, USE_PDL=True), screened.row_warps(block_x))
    stacks[f"check argmax columns={block_x}"] = stack(
        screened._check_kernel, dict(BLOCK_R=screened.CHECK_ROWS, BLOCK_X=block_x, USE_PDL=True),
        screened.row_warps(block_x))
print(json.dumps(stacks))
"""


def test_compiles_for_hopper_without_spills():
    # the interpreter never compiles a kernel: compile each variant for sm_90 (Triton's bundled ptxas, the GPU's
    # tiles) in a process without it, and read the per-thread stack (register spills) from cuobjdump
    # (and the greedy head's row kernels, which the top-k head shares or mirrors, at up to 8,192 columns)
    stacks = run_without_interpreter(COMPILE_FOR_HOPPER)
    assert len(stacks) == 15 and all(size == 0 for size in stacks.values()), stacks


# ---- GPU, the real shape ----------------------------------------------------------------------------

VOCAB, HIDDEN = 248320, 1024
QWEN = [(0.7, 20, 0.8, 0.0), (1.0, 20, 0.95, 0.0), (0.7, 20, 0.8, 1.5), (1.0, 20, 0.95, 1.5)]  # (T, k, p, presence)


def real_step(rows, setting, seed):
    temperature, top_k, top_p, presence = setting
    x = make((rows, HIDDEN), torch.bfloat16, "cuda", seed=seed)
    sampling = dict(temperature=torch.full((rows,), temperature, device="cuda"),
                    top_k=torch.full((rows,), top_k, dtype=torch.int32, device="cuda"),
                    top_p=torch.full((rows,), top_p, device="cuda"), min_p=torch.zeros(rows, device="cuda"),
                    seed=torch.tensor([seed], device="cuda"), step=torch.zeros(rows, dtype=torch.int64, device="cuda"))
    penalties = {}
    if presence:
        generator = torch.Generator().manual_seed(seed)
        counts = torch.zeros(rows, VOCAB, dtype=torch.int32)
        counts.scatter_(1, torch.randint(0, VOCAB, (rows, 200), generator=generator), 1)  # 200 generated ids
        penalties = dict(counts=counts.cuda(), prompt_mask=torch.zeros(rows, VOCAB, dtype=torch.bool, device="cuda"),
                         repetition=torch.ones(rows, device="cuda"), frequency=torch.zeros(rows, device="cuda"),
                         presence=torch.full((rows,), presence, device="cuda"), slots=None)
    return x, sampling, penalties


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("setting", QWEN, ids=["t0.7", "t1.0", "t0.7-presence", "t1.0-presence"])
def test_gpu_qwen_settings_draw_the_logits_paths_ids(rows, setting):
    weight = make((VOCAB, HIDDEN), torch.bfloat16, "cuda", seed=51, scale=0.05)
    norm_weight = make((HIDDEN,), torch.bfloat16, "cuda", seed=52, scale=0.3)
    for seed in (1, 2, 3):
        x, sampling, penalties = real_step(rows, setting, seed)
        logits = screened(x, weight, sampling, penalties, norm_weight)
        counts = top_k_candidate_counts(x, VOCAB)
        print(f"screened top-k head, {rows} rows, {setting}: candidates {counts} of {VOCAB}")
        assert max(counts) <= 5000 + 200 * (setting[3] > 0)
        expected = full_logits(x, weight, penalties, norm_weight)
        exact, penalised = reference_penalised(x, weight, penalties, rows)
        assert_top_k_exact(logits, exact, penalised, sampling, penalties)
        for step in range(8):
            sampling["step"] = sampling["step"] + 1
            assert torch.equal(draw(logits, sampling), draw(expected, sampling))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_gpu_screened_top_k_cuda_graph(rows):
    """Captured with PDL, replayed on new inputs: the eager logits bit for bit, and the logits path's ids."""
    from tests.support import graph_replays_as_eager

    weight = make((VOCAB, HIDDEN), torch.bfloat16, "cuda", seed=60, scale=0.05)
    norm_weight = make((HIDDEN,), torch.bfloat16, "cuda", seed=61, scale=0.3)
    screen = build_screen(weight)
    x, sampling, penalties = real_step(rows, QWEN[3], 62)
    logits = torch.empty(rows, VOCAB, device="cuda")

    def step():
        lm_head_screened_top_k(x, weight, screen, logits, sampling["temperature"], sampling["top_k"],
                               norm_weight=norm_weight, eps=EPS, pdl=True, **penalties)

    step()  # warm-up
    for seed in (63, 64):
        x.copy_(make((rows, HIDDEN), torch.bfloat16, "cuda", seed=seed))
        eager = graph_replays_as_eager(step, logits)
        assert torch.equal(draw(eager, sampling), draw(full_logits(x, weight, penalties, norm_weight), sampling))
