"""The Triton backend as a whole: against transformers on the CPU (interpreter, float32, tiny configs),
and on the GPU at the real 0.8B shape in bf16 against the float32 reference."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

from qwen_triton import LLM
from qwen_triton.engine import triton_model
from tests.support import relative_error, small_config, transformers_model, transformers_score, write_checkpoint

TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for layout in ("conditional", "causal"):
        config = small_config(tie_word_embeddings=layout == "conditional")
        made[layout] = write_checkpoint(tmp_path_factory.mktemp(layout), config, layout=layout, seed=11)
    return made


def _oracle(directory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers_model(directory)


@pytest.mark.parametrize("layout, length, prefill", [
    ("conditional", 67, 67),  # all prefill, across the 64-token chunk boundary
    ("causal", 66, 64),       # one full chunk, then decode steps
    ("causal", 6, 0),         # decode only
])
def test_score_matches_transformers(checkpoints, layout, length, prefill):
    directory = checkpoints[layout]
    llm = LLM(directory, backend="triton", device="cpu", dtype=torch.float32, max_length=80)
    token_ids = torch.randint(0, llm.config.vocab_size, (length,), generator=torch.Generator().manual_seed(5)).tolist()
    expected = transformers_score(_oracle(directory), token_ids, prefill)
    assert relative_error(llm.score(token_ids, prefill=prefill), expected) <= TOLERANCE


def test_norms_folded_into_the_projections_or_not(checkpoints):
    """By default the pre-projection norms' (1 + w) are folded into the projections' weights (the kernels see zero
    norm weights); with fold_norms=False the weights are the checkpoint's and the prefill's norms run as the GEMM's
    prologue pass: both match transformers over a prefill the GEMM serves (20 tokens) and decode steps."""
    directory = checkpoints["causal"]
    token_ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(12)).tolist()
    expected = transformers_score(_oracle(directory), token_ids, 20)
    for fold in (True, False):
        llm = LLM(directory, backend="triton", device="cpu", dtype=torch.float32, max_length=40, fold_norms=fold)
        norms = [w.input_norm for w in llm.model.layers] + [m.input_norm for m in llm.model.mlps]
        assert llm.model.plan.fold_norms == fold and all(bool((n == 0).all()) == fold for n in norms)
        assert relative_error(llm.score(token_ids, prefill=20), expected) <= TOLERANCE


def test_decode_with_the_three_projections_matches_transformers(checkpoints):
    # out_projection_mlp=False: each layer's out-projection and MLP as three `linear` calls, as before it
    directory = checkpoints["causal"]
    llm = LLM(directory, backend="triton", device="cpu", dtype=torch.float32, max_length=16, out_projection_mlp=False)
    token_ids = torch.randint(0, llm.config.vocab_size, (6,), generator=torch.Generator().manual_seed(6)).tolist()
    expected = transformers_score(_oracle(directory), token_ids, 0)
    assert relative_error(llm.score(token_ids, prefill=0), expected) <= TOLERANCE


def test_decode_with_the_projected_deltanet_step_matches_transformers(tmp_path, monkeypatch):
    # head dims of 16: a one-sequence decode step runs each DeltaNet layer's in-projection and step as one
    # kernel (projected_decode.py); the same checkpoint with the option off runs the GEMV and the fused step
    config = small_config(linear_key_head_dim=16, linear_value_head_dim=32)
    directory = write_checkpoint(tmp_path, config, layout="causal", seed=12)
    calls = []
    original = triton_model.gated_delta_rule_decode_projected
    monkeypatch.setattr(triton_model, "gated_delta_rule_decode_projected",
                        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    token_ids = torch.randint(0, config["vocab_size"], (7,), generator=torch.Generator().manual_seed(9)).tolist()
    expected = transformers_score(_oracle(directory), token_ids, 2)
    scores = {}
    for projected in (True, False):
        calls.clear()
        llm = LLM(directory, backend="triton", device="cpu", dtype=torch.float32, max_length=16,
                  projected_delta_decode=projected)
        scores[projected] = llm.score(token_ids, prefill=2)
        assert len(calls) == (5 * 3 if projected else 0)  # 5 decode steps x 3 DeltaNet layers
        assert relative_error(scores[projected], expected) <= TOLERANCE
    assert relative_error(scores[True], scores[False]) <= 1e-5


def test_reset_zeroes_the_states_and_no_kernel_reads_the_cache_past_the_sequence(checkpoints):
    # reset leaves the KV cache as it is (state.py): NaN in every cache position and in the conv and
    # recurrent states before a sequence must change no logit of a prefill or of the decode steps after it
    llm = LLM(checkpoints["causal"], backend="triton", device="cpu", dtype=torch.float32, max_length=24)
    token_ids = torch.randint(0, llm.config.vocab_size, (12,), generator=torch.Generator().manual_seed(8)).tolist()
    fresh = llm.score(token_ids, prefill=9)
    state = llm.model.state
    for tensors in (state.key, state.value, state.conv, state.recurrent):
        for tensor in tensors.values():
            tensor.fill_(float("nan"))
    again = llm.score(token_ids, prefill=9)
    assert torch.isfinite(fresh).all()
    assert torch.equal(again, fresh)
    assert all(torch.isnan(tensor[0, :, 12:]).all() for tensor in state.key.values())  # not zeroed by reset


def test_decode_attention_is_first_called_over_the_whole_cache(checkpoints, monkeypatch):
    # TritonModel._tune_decode_attention: the autotuner's one pick is made over the longest context the model
    # serves, once per model, before the first step; the logits are those of the model without it (the option
    # tune_decode_attention_at_full_length=False)
    calls = []
    original = triton_model.attention_decode
    monkeypatch.setattr(triton_model, "attention_decode", lambda q, key, value, lengths, **options:
                        calls.append(lengths.tolist()) or original(q, key, value, lengths, **options))
    token_ids = torch.randint(0, 300, (7,), generator=torch.Generator().manual_seed(9)).tolist()
    tuned = LLM(checkpoints["causal"], backend="triton", device="cpu", dtype=torch.float32,
                max_length=16).score(token_ids, prefill=2)
    assert calls[0] == [16]
    assert len(calls) > 1 and all(max(lengths) <= len(token_ids) for lengths in calls[1:])
    calls.clear()
    plain = LLM(checkpoints["causal"], backend="triton", device="cpu", dtype=torch.float32,
                max_length=16, tune_decode_attention_at_full_length=False).score(token_ids, prefill=2)
    assert calls and all(max(lengths) <= len(token_ids) for lengths in calls)
    assert torch.equal(tuned, plain)


def test_greedy_generate_matches_transformers(checkpoints):
    directory = checkpoints["conditional"]
    llm = LLM(directory, backend="triton", device="cpu", dtype=torch.float32, max_length=32)
    prompt = [11, 200, 3, 47, 150]
    result = llm.generate(prompt, max_new_tokens=4)
    oracle = _oracle(directory)
    with torch.no_grad():
        expected = oracle.generate(torch.tensor([prompt]), max_new_tokens=len(result.token_ids), do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert result.token_ids == expected


def test_greedy_steps_through_the_screened_lm_head(checkpoints, monkeypatch):
    # greedy, a batch and one sequence alone: the LM head's int8 screen and exact check (lm_head/screened.py);
    # the same tokens as the full head (screened_lm_head=False)
    calls = []
    original = triton_model.lm_head_argmax_screened
    monkeypatch.setattr(triton_model, "lm_head_argmax_screened",
                        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    prompts = [[11, 200, 3, 47, 150], [5, 6], [9, 9, 9]]
    tokens = {}
    for screened in (True, False):
        calls.clear()
        llm = LLM(checkpoints["conditional"], backend="triton", device="cpu", dtype=torch.float32, max_length=32,
                  max_batch=4, screened_lm_head=screened)
        tokens[screened] = [r.token_ids for r in llm.generate(prompts, max_new_tokens=4)]
        assert bool(calls) == screened
        alone = llm.generate(prompts[0], max_new_tokens=4).token_ids  # a batch of one (its one-row epilogue)
        assert alone == tokens[screened][0]
    assert tokens[True] == tokens[False] and all(len(ids) == 4 for ids in tokens[True])


def test_qwens_sampling_settings_step_through_the_screened_top_k_head(checkpoints, monkeypatch):
    # Qwen's recommended settings, with and without presence_penalty 1.5, in one batch (penalized-top-k) and each
    # alone: the screened top-k head (lm_head/screened_top_k.py, the penalties in it, no penalties kernel) draws the
    # tokens of the logits head (screened_lm_head=False)
    from qwen_triton.engine.sampling import SamplingParams

    calls = {"screened": 0, "penalties": 0}
    for name, key in (("lm_head_screened_top_k", "screened"), ("apply_penalties", "penalties")):
        original = getattr(triton_model, name)
        monkeypatch.setattr(triton_model, name, lambda *args, _original=original, _key=key, **kwargs:
                            calls.__setitem__(_key, calls[_key] + 1) or _original(*args, **kwargs))
    settings = [SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=1),
                SamplingParams(temperature=1.0, top_p=0.95, top_k=20, seed=2, presence_penalty=1.5),
                SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=3, presence_penalty=1.5),
                SamplingParams(temperature=1.0, top_p=0.95, top_k=20, seed=4)]
    prompts = [[11, 200, 3, 47, 150], [5, 6], [9, 9, 9], [7, 100]]
    tokens = {}
    for screened in (True, False):
        calls.update(screened=0, penalties=0)
        llm = LLM(checkpoints["conditional"], backend="triton", device="cpu", dtype=torch.float32, max_length=32,
                  max_batch=4, screened_lm_head=screened)
        tokens[screened] = [r.token_ids for r in llm.generate(prompts, max_new_tokens=4, sampling_params=settings)]
        alone = [llm.generate(prompts[0], max_new_tokens=4, sampling_params=settings[0]).token_ids]  # top-k mode
        assert alone == tokens[screened][:1]
        # 3 decode steps of the batch, 3 of the row alone (its first token: the prefill's logits)
        assert calls == ({"screened": 6, "penalties": 0} if screened else {"screened": 0, "penalties": 3})
    assert tokens[True] == tokens[False] and all(len(ids) == 4 for ids in tokens[True])


def test_batched_generation_equals_one_at_a_time(checkpoints):
    llm = LLM(checkpoints["causal"], backend="triton", device="cpu", dtype=torch.float32, max_length=32,
              max_batch=4)
    prompts = [[5, 6, 7], [100, 3], [9, 9, 9, 9, 1]]
    together = llm.generate(prompts, max_new_tokens=3, temperature=0.9, seed=3)
    alone = [llm.generate(p, max_new_tokens=3, temperature=0.9, seed=3) for p in prompts]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


def test_out_of_vocabulary_and_too_long_prompts(checkpoints):
    llm = LLM(checkpoints["causal"], backend="triton", device="cpu", dtype=torch.float32, max_length=16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([1, 10_000], max_new_tokens=2)
    with pytest.raises(ValueError, match="maximum length 16"):
        llm.generate(list(range(17)), max_new_tokens=2)


# ---- GPU, real shape ---------------------------------------------------------------------------------

def test_first_prefill_shows_its_progress(checkpoints, capsys):
    """Once per model, naming what the first run costs: compiling and tuning on a GPU; under the interpreter
    (here, without a GPU) nothing is compiled, and the line says so."""
    llm = LLM(checkpoints["causal"], backend="triton", device="cpu", dtype=torch.float32, max_length=16,
              progress=True)
    llm.score([1, 2, 3], prefill=3)
    first = capsys.readouterr().err
    llm.score([4, 5], prefill=2)
    assert ("first prefill: the kernels run under Triton's interpreter (nothing is compiled or tuned), layers: 4/4"
            in first)
    assert "first prefill" not in capsys.readouterr().err  # once per model


def _real_model(backend, dtype, **options):
    from qwen_triton.benchmark.models import random_llm

    return random_llm("0.8b", backend=backend, dtype=dtype, max_length=512, **options)


def _step_errors(scored, reference):
    """Per-step relative error (max over the vocabulary / max |logit|) and top-1 agreement."""
    errors = (scored - reference).abs().amax(-1) / reference.abs().amax(-1)
    return errors, (scored.argmax(-1) == reference.argmax(-1)).float().mean().item()


@pytest.mark.gpu
@pytest.mark.parametrize("prefill", [128, 320])
def test_gpu_bf16_logits_against_float32_reference_over_384_tokens(prefill):
    """A prefill (128 tokens: split-K GEMMs, two delta-rule chunks; 320: the GEMMs' TMA loads, five chunks)
    then teacher-forced decode steps up to 384 tokens, at the real shape. bf16 rounds every
    activation (unit roundoff 2^-9) through 24 layers; how far that moves the logits depends on the
    weights, so the bound is set by the reference model itself run in bf16 on the same weights: the
    Triton engine's error against the float32 reference may exceed the bf16 reference's by at most half
    again (median and max), and its top-1 agreement may trail it by at most 5 points."""
    token_ids = torch.randint(0, 248_000, (384,), generator=torch.Generator().manual_seed(0)).tolist()
    scores = {}
    for name, backend, dtype in (("triton", "triton", torch.bfloat16), ("reference-bf16", "reference", torch.bfloat16),
                                 ("reference-fp32", "reference", torch.float32)):
        scores[name] = _real_model(backend, dtype).score(token_ids, prefill=prefill)
        torch.cuda.empty_cache()
    ours, ours_agreement = _step_errors(scores["triton"], scores["reference-fp32"])
    bf16, bf16_agreement = _step_errors(scores["reference-bf16"], scores["reference-fp32"])
    print(f"\nprefill {prefill}: bf16 vs fp32 reference over {len(ours)} steps: "
          f"triton median {ours.median():.3e} max {ours.max():.3e} top-1 {ours_agreement:.3f}; "
          f"reference-bf16 median {bf16.median():.3e} max {bf16.max():.3e} top-1 {bf16_agreement:.3f}")
    assert ours.median() <= 1.5 * bf16.median()
    assert ours.max() <= 1.5 * bf16.max()
    assert ours_agreement >= bf16_agreement - 0.05


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_is_bit_identical_to_eager_kernels():
    token_ids = torch.randint(0, 248_000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    graphed = _real_model("triton", torch.bfloat16).score(token_ids, prefill=8)
    torch.cuda.empty_cache()
    eager = _real_model("triton", torch.bfloat16, cuda_graph=False).score(token_ids, prefill=8)
    assert torch.equal(graphed, eager)


@pytest.mark.gpu
def test_gpu_prefill_graph_replay_is_bit_identical_to_eager_prefill():
    # the second prefill of a length is captured, the third replays: logits and every state as eager
    token_ids = torch.randint(0, 248_000, (100,), generator=torch.Generator().manual_seed(3)).cuda()
    graphed = _real_model("triton", torch.bfloat16).model
    runs = []
    for _ in range(3):
        graphed.reset(0)
        runs.append((graphed.prefill(token_ids, slot=0, all_logits=True),
                     graphed.state.recurrent[0][0].clone(), graphed.state.conv[0][0].clone(),
                     graphed.state.key[3][0].clone()))
    assert len(graphed.prefill_graphs.graphs) == 1
    torch.cuda.empty_cache()
    eager = _real_model("triton", torch.bfloat16, cuda_graph=False).model
    eager.reset(0)
    expected = (eager.prefill(token_ids, slot=0, all_logits=True), eager.state.recurrent[0][0],
                eager.state.conv[0][0], eager.state.key[3][0])
    assert torch.isfinite(expected[0]).all()
    for run in runs:
        for got, want in zip(run, expected):
            assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_programmatic_dependent_launch_changes_no_bit(monkeypatch):
    # PDL only lets kernels start early; every read of an earlier kernel's output follows its wait. The decode
    # step's LM head is launched without it all the same (the plan's lm_head_pdl: measured faster)
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    lm_head_pdl = []
    for name in ("lm_head_logits", "lm_head_argmax"):
        original = getattr(triton_model, name)
        monkeypatch.setattr(triton_model, name, lambda *args, original=original, **kwargs:
                            lm_head_pdl.append(kwargs.get("pdl")) or original(*args, **kwargs))
    token_ids = torch.randint(0, 248_000, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with_pdl = _real_model("triton", torch.bfloat16, pdl=True).score(token_ids, prefill=8)
    assert False in lm_head_pdl and True not in lm_head_pdl  # the decode step's (the prefill's passes none)
    torch.cuda.empty_cache()
    without = _real_model("triton", torch.bfloat16, pdl=False).score(token_ids, prefill=8)
    assert torch.isfinite(with_pdl).all()
    assert torch.equal(with_pdl, without)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [40, 128])
def test_gpu_prefill_with_programmatic_dependent_launch_changes_no_bit(tokens):
    # a short prefill's kernels with PDL (the plan's prefill_pdl_tokens: GEMMs with and without split-K, their
    # prologues, the conv, the attention), eager, captured and replayed: logits and states as without
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    token_ids = torch.randint(0, 248_000, (tokens,), generator=torch.Generator().manual_seed(4)).cuda()
    results = {}
    for pdl in (True, False):
        model = _real_model("triton", torch.bfloat16, pdl=pdl).model
        assert model.plan.prefill_pdl(tokens) == pdl
        runs = []
        for _ in range(3):  # eager, captured, replayed
            model.reset(0)
            runs.append((model.prefill(token_ids, slot=0, all_logits=True), model.state.recurrent[0][0].clone(),
                         model.state.conv[0][0].clone(), model.state.key[3][0].clone()))
        results[pdl] = runs
        del model
        torch.cuda.empty_cache()
    assert torch.isfinite(results[False][0][0]).all()
    for run in results[True] + results[False]:
        for got, want in zip(run, results[False][0]):
            assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_batched_generation_equals_one_at_a_time():
    llm = _real_model("triton", torch.bfloat16)
    prompts = [[5, 6, 7, 8], list(range(100, 140)), [9] * 17]
    for temperature in (0.0, 0.8):
        together = llm.generate(prompts, max_new_tokens=24, temperature=temperature, seed=3)
        alone = [llm.generate(p, max_new_tokens=24, temperature=temperature, seed=3) for p in prompts]
        assert [r.token_ids for r in together] == [r.token_ids for r in alone]


@pytest.mark.gpu
def test_gpu_running_ahead_of_the_host_generates_the_same_tokens():
    llm = _real_model("triton", torch.bfloat16)
    prompts = [[5, 6, 7, 8], list(range(100, 140))]
    for temperature in (0.0, 0.8):
        results = {}
        for ahead in (False, True):
            llm.run_ahead = ahead
            results[ahead] = [r.token_ids for r in llm.generate(prompts, max_new_tokens=64, temperature=temperature,
                                                                  seed=3)]
        assert results[True] == results[False]
        assert all(len(ids) == 64 for ids in results[True])  # random weights: no end-of-turn id expected


@pytest.mark.gpu
def test_gpu_second_start_reuses_the_autotune_cache(tmp_path):
    script = (
        "import torch, time\n"
        "from tests.engine.test_triton_engine import _real_model\n"
        "t = time.perf_counter()\n"
        "llm = _real_model('triton', torch.bfloat16)\n"
        "llm.generate([1, 2, 3], max_new_tokens=4)\n"
        "print('WARM', time.perf_counter() - t)\n"
    )
    # two configs per kernel: a real tuning (the first start prints its choices), kept short
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_PRINT_AUTOTUNING="1",
               QWEN_TRITON_AUTOTUNE="2")
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert "best config" in runs[0].stdout.lower() + runs[0].stderr.lower()
    assert "best config" not in runs[1].stdout.lower() + runs[1].stderr.lower()


def test_running_ahead_of_the_host_generates_the_same_tokens(checkpoints):
    # steps launched before the host has read the previous one's ids (engine/decode_pipeline.py): the same
    # ids (temperature: the draw counter is fed back too), with a row that stops early (budgets 4 and 1
    # under max_length 8) and a last step at the last position
    llm = LLM(checkpoints["causal"], backend="triton", device="cpu", dtype=torch.float32, max_length=8,
              max_batch=2)
    prompts = [[5, 6, 7, 8], [9, 9, 9, 9, 1, 2, 3]]
    results = {}
    for ahead in (False, True):
        llm.run_ahead = ahead
        results[ahead] = [r.token_ids for r in llm.generate(prompts, max_new_tokens=10, temperature=0.9, seed=3)]
    assert [len(ids) for ids in results[True]] == [4, 1]
    assert results[True] == results[False]


def test_decode_pipeline_refuses_inputs_the_step_ahead_did_not_run_on(checkpoints):
    from qwen_triton.engine.decode_pipeline import DecodePipeline
    from qwen_triton.engine.sampling import SamplingParams
    from qwen_triton.engine.device_sampling import DeviceSampling

    llm = LLM(checkpoints["causal"], backend="triton", device="cpu", dtype=torch.float32, max_length=12)
    pipeline = DecodePipeline(llm.model, DeviceSampling.build([SamplingParams()], llm.device), ahead=True)
    first = pipeline.step([5], [0], [0], [True])
    assert pipeline.step(first, [1], [1], [True]) is not None  # the continuation it ran ahead on
    with pytest.raises(RuntimeError, match="row 0 continues from id"):
        pipeline.step([first[0] + 1], [2], [2], [True])
    llm.model.decode_tokens(torch.tensor([1]), torch.tensor([0]), pipeline.sampling, None)  # no feedback
    with pytest.raises(ValueError, match="did not run with feedback"):
        llm.model.decode_tokens(None, None, pipeline.sampling, None)


@pytest.mark.gpu
def test_gpu_staged_layer_tail_runs_and_matches_the_three_launches(monkeypatch):
    # one sequence on Hopper: every layer's out-projection and MLP is one staged_out_projection_mlp launch
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("staged_out_projection_mlp needs compute capability 9.0 (TMA)")
    calls = []
    original = triton_model.staged.staged_out_projection_mlp
    monkeypatch.setattr(triton_model.staged, "staged_out_projection_mlp",
                        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    token_ids = torch.randint(0, 248_000, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    scores = {}
    for staged in (True, False):
        calls.clear()
        llm = _real_model("triton", torch.bfloat16, staged_out_projection_mlp=staged, cuda_graph=False)
        scores[staged] = llm.score(token_ids, prefill=8).float()
        assert len(calls) == (16 * 24 if staged else 0)  # 16 decode steps x 24 layers
        del llm
        torch.cuda.empty_cache()
    assert torch.isfinite(scores[True]).all()
    errors, agreement = _step_errors(scores[True], scores[False])
    print(f"staged against three launches: max relative logit difference {errors.max().item():.3e}, "
          f"top-1 agreement {agreement:.3f}")
    assert errors.max() < 5e-2 and agreement >= 0.9
