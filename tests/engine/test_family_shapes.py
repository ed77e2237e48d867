"""The dense Qwen3.5 family's shape features on the Triton backend, against transformers on the CPU (interpreter,
float32, small configs): more DeltaNet value heads than key heads (3x as the 27B, 2x as the 4B and 9B), an
untied LM head (9B, 27B), a GQA group of 3 (the 27B's 24 query heads over 4 KV heads), a hidden size past 4,096
columns (27B) through the screened LM head, and one past its 8,192; and the plans of the family's presets on the
H200."""

import dataclasses
import warnings

import pytest
import torch

from qwen_triton import LLM
from qwen_triton.checkpoint import PRESETS, official_config
from qwen_triton.cli import main
from qwen_triton.config import parse_config
from qwen_triton.engine import plan as plans
from qwen_triton.engine import triton_model
from qwen_triton.engine.plan import DEVICES, Options, resolve_plan
from tests.support import relative_error, small_config, transformers_model, transformers_score, write_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")

TOLERANCE = 2e-3  # test_triton_engine.py's

SHAPES = {
    # DeltaNet value heads = 3 x key heads, head dims the projected one-sequence step tiles (multiples of 16)
    "value heads 3x key heads": dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
                                     linear_value_head_dim=32, tie_word_embeddings=False),
    # 2 x, head dims the projected step does not tile (the fused step serves a one-sequence decode)
    "value heads 2x key heads, tied": dict(linear_num_key_heads=2, linear_num_value_heads=4,
                                           tie_word_embeddings=True),
    # 6 query heads over 2 KV heads (a GQA group of 3, as 24 over 4) and an untied head
    "query heads 6 over 2": dict(num_attention_heads=6, num_key_value_heads=2, linear_num_key_heads=2,
                                 linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=32,
                                 tie_word_embeddings=False),
}


def _oracle(directory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers_model(directory)


# how each is stored: the official layout sharded (with its untied head), or a Qwen3_5ForCausalLM export
STORED = {"value heads 3x key heads": dict(layout="conditional", shards=2)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: write_checkpoint(tmp_path_factory.mktemp("shape"), small_config(**overrides), seed=21,
                                   **STORED.get(name, dict(layout="causal")))
            for name, overrides in SHAPES.items()}


def _oracle_greedy(oracle, prompt: list[int], count: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, `count` tokens, no end-of-sequence stop."""
    with torch.no_grad():
        return oracle.generate(torch.tensor([prompt]), max_new_tokens=count, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(SHAPES))
def test_score_and_greedy_generation_match_transformers(checkpoints, name):
    directory = checkpoints[name]
    oracle = _oracle(directory)
    llm = LLM(directory, backend="triton", device="cpu", dtype=torch.float32, max_length=48)
    token_ids = torch.randint(0, llm.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    # a prefill of 34 tokens (the GEMM), then decode steps (one sequence: the projected or fused DeltaNet step)
    assert relative_error(llm.score(token_ids, prefill=34), transformers_score(oracle, token_ids, 34)) <= TOLERANCE
    prompt = [11, 200, 3, 47, 150]
    result = llm.generate(prompt, max_new_tokens=4)
    assert result.token_ids == _oracle_greedy(oracle, prompt, len(result.token_ids))
    reference = LLM(directory, backend="reference", device="cpu", dtype=torch.float32, max_length=48)
    assert reference.generate(prompt, max_new_tokens=4).token_ids == result.token_ids


def test_the_projected_step_serves_value_heads_3x_key_heads(checkpoints, monkeypatch):
    calls = []
    original = triton_model.gated_delta_rule_decode_projected
    monkeypatch.setattr(triton_model, "gated_delta_rule_decode_projected",
                        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    directory = checkpoints["value heads 3x key heads"]
    llm = LLM(directory, backend="triton", device="cpu", dtype=torch.float32, max_length=16)
    token_ids = torch.randint(0, llm.config.vocab_size, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    assert relative_error(llm.score(token_ids, prefill=2), transformers_score(_oracle(directory), token_ids, 2)) \
        <= TOLERANCE
    assert calls


def test_batched_decode_with_a_gqa_group_of_3(checkpoints):
    # several sequences: the fused DeltaNet step and out_projection_mlp over a batch; the screened head for greedy
    llm = LLM(checkpoints["query heads 6 over 2"], backend="triton", device="cpu", dtype=torch.float32,
              max_length=32, max_batch=4)
    prompts = [[5, 6, 7], [100, 3], [9, 9, 9, 9, 1]]
    together = [r.token_ids for r in llm.generate(prompts, max_new_tokens=3)]
    assert together == [llm.generate(p, max_new_tokens=3).token_ids for p in prompts]


def test_hidden_past_4096_columns(tmp_path):
    # hidden 4,160 > 4,096 columns (as the 27B's 5,120): the screened head serves greedy decode with 8 warps a row;
    # prefill, decode and generation match the oracle (one layer of each kind, a vocabulary of 64, so the
    # interpreter stays fast)
    config = small_config(hidden_size=4160, intermediate_size=64, vocab_size=64, eos_token_id=63,
                          num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                          tie_word_embeddings=False)
    directory = write_checkpoint(tmp_path, config, layout="causal", seed=5)
    llm = LLM(directory, backend="triton", device="cpu", dtype=torch.float32, max_length=24)
    assert llm.model.plan.screened_rows == 16 and llm.model.lm_head_screen is not None
    assert llm.model.plan.decode_lm_head(1, "greedy") == plans.HEAD_SCREENED
    oracle = _oracle(directory)
    token_ids = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    assert relative_error(llm.score(token_ids, prefill=17), transformers_score(oracle, token_ids, 17)) <= TOLERANCE
    prompt = [11, 20, 3, 47, 15]
    result = llm.generate(prompt, max_new_tokens=3)
    assert result.token_ids == _oracle_greedy(oracle, prompt, len(result.token_ids))


def test_hidden_past_the_screened_heads_columns():
    # past the screen's 8,192 columns the plan leaves the screened heads out and says why; the bf16 argmax head
    # serves greedy decode, tiled past the GEMV's hidden limit (one row runs the decode GEMM there, D165), a row a
    # program with the GEMV at every size; without the tiled head, the logits head
    config = parse_config(official_config(dict(PRESETS["27b"], hidden_size=8320)))
    plan = resolve_plan(config, DEVICES["h200"])
    assert plan.screened_rows == 0 and plan.decode_lm_head(1, "greedy") == plans.HEAD_ARGMAX and plan.argmax_tiled(1)
    assert ("the screened LM heads (hidden 8320 > their 8192 columns; the bf16 argmax head serves greedy decode, the "
            "logits head top-k sampling)") in plan.describe(config)
    unlimited = resolve_plan(config, DEVICES["h200"], tuning=dataclasses.replace(plan.tuning, gemv_hidden_limit=None))
    assert unlimited.screened_rows == 0 and unlimited.decode_lm_head(1, "greedy") == plans.HEAD_ARGMAX
    assert not unlimited.argmax_tiled(1)
    untiled = resolve_plan(config, DEVICES["h200"], Options(tiled_argmax_head=False))
    assert untiled.decode_lm_head(1, "greedy") == plans.HEAD_LOGITS
    assert "the logits head serves greedy decode and top-k sampling" in untiled.describe(config)


FAMILY = ("4b", "9b", "27b")


@pytest.mark.parametrize("preset", FAMILY)
def test_the_h200_plan_of_each_family_size(preset):
    # past the table's GEMV limit (hidden 2,048) one sequence runs as several do: the decode GEMM, its DeltaNet step
    # with the gated norm, the three-GEMM tail (D165); the staged tail takes no size past the 0.8B (its weights do
    # not fit the SMs' shared memory); the screened heads serve every size
    config = parse_config(official_config(PRESETS[preset]))
    plan = resolve_plan(config, DEVICES["h200"])
    assert plan.gemv_rows == 0 and not plan.staged_tail and not plan.projected_delta and plan.pdl and plan.cuda_graph
    assert [plan.decode_tail(rows) for rows in (1, 2, 16)] == [plans.TAIL_LINEAR] * 3
    assert plan.decode_delta(1) == plan.decode_delta(2) == plans.DELTA_FUSED_NORM
    assert plan.screened_rows == 16 and plan.decode_lm_head(1, "greedy") == plans.HEAD_SCREENED
    described = plan.describe(config)
    assert "the staged layer tail" in described and "the screened LM heads" not in described
    assert f"one sequence's GEMV and its fused paths, the layer tail and the projected DeltaNet step (hidden " \
           f"{config.hidden_size} > the h200 table's 2048" in described
    # past that limit no bucket takes the resident-weights GEMM (measured slower at the 4B, D172)
    assert plan.resident_rows == 0
    # a table without the limit: one row through the GEMV, the fused tail and the projected step, 2-16 rows through
    # the resident-weights GEMM, as at the 0.8B
    unlimited = resolve_plan(config, DEVICES["h200"], tuning=dataclasses.replace(plan.tuning, gemv_hidden_limit=None))
    assert unlimited.gemv_rows == 1 and unlimited.projected_delta and not unlimited.staged_tail
    assert unlimited.resident_rows == 16
    assert [unlimited.decode_tail(rows) for rows in (1, 2, 3)] == [plans.TAIL_FUSED] + [plans.TAIL_LINEAR] * 2
    assert unlimited.decode_delta(1) == plans.DELTA_PROJECTED
    assert "one sequence's GEMV" not in unlimited.describe(config)
    # options that ask for the GEMV at every bucket keep it
    assert resolve_plan(config, DEVICES["h200"], Options(batched_projections=False)).gemv_rows == 16


def test_the_0_8b_plan_leaves_nothing_out():
    config = parse_config(official_config(PRESETS["0.8b"]))
    assert "Left out" not in resolve_plan(config, DEVICES["h200"]).describe(config)


def test_ops_prints_the_27b_plan(capsys):
    main(["ops", "--preset", "27b", "--gpu", "h200"])
    out = capsys.readouterr().out
    assert "hidden 5120, 64 layers" in out and "Left out for this shape: the staged layer tail (hidden 5120" in out
    assert "lm_head.screened (int8 screen" in out


# ---- GPU: each size's real widths in bf16 ----------------------------------------------------------------------

def _random_model(text_config: dict, backend: str, dtype, max_length: int = 512, **options):
    """An LLM of random weights at text_config's shape, made on the GPU (benchmark/models.py's random_llm for a
    config that is no preset: fewer layers of a size's widths)."""
    import json
    import tempfile
    from pathlib import Path

    from qwen_triton.benchmark.models import random_weights

    config_json = official_config(text_config)
    folder = Path(tempfile.mkdtemp(prefix="qwen-triton-family-"))
    (folder / "config.json").write_text(json.dumps(config_json))
    weights = random_weights(parse_config(config_json), "cuda", dtype)
    return LLM(folder, backend=backend, device="cuda", dtype=dtype, max_length=max_length, weights=weights, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", FAMILY)
def test_gpu_bf16_logits_against_float32_reference_at_each_size(preset):
    """The size's widths over 8 layers (two of each kind's groups; the float32 reference of the whole 27B would not
    fit beside it): a 128-token prefill then teacher-forced decode steps to 192 tokens, bounded as
    test_triton_engine.py's 0.8B test bounds them, by the reference model run in bf16 on the same weights."""
    text = dict(PRESETS[preset], num_hidden_layers=8, layer_types=PRESETS[preset]["layer_types"][:8])
    token_ids = torch.randint(0, 248_000, (192,), generator=torch.Generator().manual_seed(0)).tolist()
    scores = {}
    for name, backend, dtype in (("triton", "triton", torch.bfloat16), ("reference-bf16", "reference", torch.bfloat16),
                                 ("reference-fp32", "reference", torch.float32)):
        llm = _random_model(text, backend, dtype)
        scores[name] = llm.score(token_ids, prefill=128).float()
        del llm
        torch.cuda.empty_cache()
    errors = {}
    for name in ("triton", "reference-bf16"):
        difference = (scores[name] - scores["reference-fp32"]).abs().amax(-1) / scores["reference-fp32"].abs().amax(-1)
        agreement = (scores[name].argmax(-1) == scores["reference-fp32"].argmax(-1)).float().mean().item()
        errors[name] = difference, agreement
    (ours, ours_agreement), (bf16, bf16_agreement) = errors["triton"], errors["reference-bf16"]
    print(f"\n{preset} (8 layers): triton median {ours.median():.3e} max {ours.max():.3e} top-1 {ours_agreement:.3f}; "
          f"reference-bf16 median {bf16.median():.3e} max {bf16.max():.3e} top-1 {bf16_agreement:.3f}")
    assert ours.median() <= 1.5 * bf16.median() and ours.max() <= 1.5 * bf16.max()
    assert ours_agreement >= bf16_agreement - 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("preset", FAMILY)
def test_gpu_each_size_loads_whole_and_generates(preset):
    # every layer at the real shape (the 27B: 54 GB of bf16 weights), the plan's variants for the size, greedy
    # decode through CUDA graphs equal to the eager kernels
    from qwen_triton.benchmark.models import random_llm

    prompt = torch.randint(0, 248_000, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    tokens = {}
    for graphs in (True, False):
        llm = random_llm(preset, max_length=256, cuda_graph=graphs)
        assert llm.model.lm_head_screen is not None  # every size's hidden is within the screened heads' columns
        tokens[graphs] = llm.generate(prompt, max_new_tokens=8).token_ids
        del llm
        torch.cuda.empty_cache()
    assert len(tokens[True]) == 8 and tokens[True] == tokens[False]
