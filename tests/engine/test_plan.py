"""The plan: which kernel runs each operator at each bucket, resolved for a device that need not be present."""

import dataclasses

import pytest
import torch

from qwen_triton.checkpoint import PRESETS, official_config
from qwen_triton.cli import main
from qwen_triton.config import parse_config
from qwen_triton.engine import plan as plans
from qwen_triton.engine.plan import DEVICES, Options, resolve_plan

CONFIG = parse_config(official_config(PRESETS["0.8b"]))
H200 = DEVICES["h200"]


def test_the_h200_plan_of_the_0_8b_model():
    plan = resolve_plan(CONFIG, H200)
    assert plan.pdl and plan.cuda_graph and plan.fold_norms and plan.split_k and plan.tuning.name == "h200"
    # one row (the table's gemv_most_rows): the GEMV and the fused kernels; 2-16 rows (resident_most_rows) the
    # resident-weights GEMM, more the tiled GEMM (each weight read once for all rows), norms folded
    assert plan.gemv_rows == plan.tuning.gemv_most_rows == 1
    assert plan.resident_rows == plan.tuning.resident_most_rows == 16
    assert [plan.decode_tail(rows) for rows in (1, 2, 3, 16, 32)] == [plans.TAIL_STAGED] + [plans.TAIL_LINEAR] * 4
    assert [plan.decode_delta(rows) for rows in (1, 2, 3, 32)] == [plans.DELTA_PROJECTED] + [
        plans.DELTA_FUSED_NORM] * 3
    assert [plan.decode_folded_norm(rows) for rows in (1, 2, 3, 128)] == [False, True, True, True]
    # greedy past the screened head's 16 rows, and temperature past one row: the argmax heads, tiled
    assert [plan.decode_lm_head(rows, "greedy") for rows in (1, 16, 32)] == [plans.HEAD_SCREENED] * 2 + [
        plans.HEAD_ARGMAX]
    assert plan.decode_lm_head(1, "temperature") == plan.decode_lm_head(2, "temperature") == plans.HEAD_GUMBEL
    assert [plan.argmax_tiled(rows) for rows in (1, 2, 128)] == [False, True, True]
    untiled = resolve_plan(CONFIG, H200, Options(tiled_argmax_head=False))
    assert untiled.decode_lm_head(32, "greedy") == untiled.decode_lm_head(2, "temperature") == plans.HEAD_LOGITS
    assert untiled.decode_lm_head(1, "temperature") == plans.HEAD_GUMBEL
    two_rows = resolve_plan(CONFIG, H200, tuning=dataclasses.replace(plan.tuning, gemv_most_rows=2))
    assert two_rows.gemv_rows == 2 and two_rows.decode_tail(2) == plans.TAIL_FUSED
    assert not two_rows.decode_folded_norm(2) and two_rows.decode_folded_norm(3)
    assert plan.decode_lm_head(1, "sample") == plan.decode_lm_head(1, "logits") == plans.HEAD_LOGITS
    assert [plan.decode_lm_head(rows, mode) for rows in (1, 16, 32) for mode in ("top-k", "penalized-top-k")] == [
        plans.HEAD_SCREENED_TOP_K] * 4 + [plans.HEAD_LOGITS] * 2
    assert not plan.lm_head_pdl and plan.screened_lm_head_pdl
    assert plan.prefill_pdl(256) and not plan.prefill_pdl(257)
    assert not plan.prefill_folded_norm(1) and plan.prefill_folded_norm(2)
    # the 64-row bucket's own GEMM picks (the table's gemm_decode_by_rows), not with batch_invariant or without the
    # option
    assert plan.bucket_gemm_picks and 64 in dict(plan.tuning.gemm_decode_by_rows)
    assert not resolve_plan(CONFIG, H200, Options(batch_invariant=True)).bucket_gemm_picks
    assert not resolve_plan(CONFIG, H200, Options(bucket_gemm_picks=False)).bucket_gemm_picks
    assert "(the bucket's own picks)" in plans._decode_rows(plan, 64)["attention in-projection"]
    assert "own picks" not in plans._decode_rows(plan, 128)["attention in-projection"]


def test_without_batched_projections_several_rows_run_the_gemv():
    plan = resolve_plan(CONFIG, H200, Options(batched_projections=False))
    assert plan.gemv_rows == 16
    assert [plan.decode_tail(rows) for rows in (1, 2, 16, 32)] == [plans.TAIL_STAGED, plans.TAIL_FUSED,
                                                                    plans.TAIL_FUSED, plans.TAIL_LINEAR]
    assert [plan.decode_delta(rows) for rows in (1, 2, 32)] == [plans.DELTA_PROJECTED, plans.DELTA_FUSED,
                                                               plans.DELTA_FUSED_NORM]
    assert [plan.decode_lm_head(rows, "greedy") for rows in (1, 16, 32)] == [plans.HEAD_SCREENED] * 2 + [
        plans.HEAD_ARGMAX]
    assert plan.decode_lm_head(16, "temperature") == plans.HEAD_GUMBEL and not plan.argmax_tiled(16)
    assert not plan.decode_folded_norm(16) and plan.decode_folded_norm(17)
    assert not plan.prefill_folded_norm(16) and plan.prefill_folded_norm(17)


def test_batch_invariant_runs_one_row_as_several():
    plan = resolve_plan(CONFIG, H200, Options(batch_invariant=True))
    assert plan.gemv_rows == 0 and not plan.staged_tail and not plan.projected_delta
    # one kernel for every bucket's projections (the tiled GEMM) and one config for every bucket's DeltaNet step
    assert plan.resident_rows == 0 and plan.step_tuning_rows == plans.INVARIANT_STEP_TUNING_ROWS
    assert resolve_plan(CONFIG, H200).step_tuning_rows is None
    for rows in (1, 2, 128):
        assert plan.decode_tail(rows) == plans.TAIL_LINEAR and plan.decode_delta(rows) == plans.DELTA_FUSED_NORM
        assert plan.decode_folded_norm(rows) and plan.decode_lm_head(rows, "temperature") == plans.HEAD_GUMBEL
        assert plan.argmax_tiled(rows)
    assert plan.decode_lm_head(1, "greedy") == plan.decode_lm_head(16, "greedy") == plans.HEAD_SCREENED
    with pytest.raises(ValueError, match="batch_invariant=True needs batched_projections=True"):
        resolve_plan(CONFIG, H200, Options(batch_invariant=True, batched_projections=False))


def test_the_resident_gemm_serves_the_buckets_past_the_gemv_up_to_its_rows():
    assert resolve_plan(CONFIG, H200, Options(resident_gemm=False)).resident_rows == 0
    assert resolve_plan(CONFIG, H200, Options(resident_most_rows=32)).resident_rows == 32
    assert resolve_plan(CONFIG, H200, Options(resident_most_rows=1000)).resident_rows == 128
    # past the GEMV's hidden limit (the 4B and larger) every bucket takes the tiled GEMM
    assert resolve_plan(parse_config(official_config(PRESETS["4b"])), H200).resident_rows == 0
    described = resolve_plan(CONFIG, H200).describe(CONFIG, decode_rows=(1, 2, 16, 32), prefill_tokens=(16, 32))
    lines = [line for line in described.splitlines() if "in-projection" in line]
    assert lines and "resident_gemm:_resident_kernel" in lines[0] and "gemm:_gemm_kernel" in lines[0]


def test_the_printed_plan_names_the_tiled_head_and_the_gated_merge():
    described = resolve_plan(CONFIG, H200).describe(CONFIG, decode_rows=(1, 32), prefill_tokens=(16,))
    decode_table = described.split("| decode rows (bucket) |", 1)[1].split("\n\n", 1)[0]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in decode_table.splitlines()
            if line.startswith("| ")}
    assert "_lm_head_argmax_tiled_kernel" not in rows["LM head (greedy)"][0]
    assert "_lm_head_argmax_tiled_kernel" in rows["LM head (greedy)"][1]
    assert "_lm_head_argmax_kernel (Gumbel-max)" in rows["LM head (temperature / top-p)"][0]
    assert "_lm_head_argmax_tiled_kernel (Gumbel-max)" in rows["LM head (temperature / top-p)"][1]
    assert "output gate in the merge" not in rows["attention"][0] and "output gate in the merge" in rows["attention"][1]


def test_options_turn_variants_off():
    plan = resolve_plan(CONFIG, H200, Options(out_projection_mlp=False, screened_lm_head=False, pdl=False,
                                              fold_norms=False))
    assert plan.decode_tail(1) == plans.TAIL_LINEAR and not plan.staged_tail and not plan.projected_delta
    assert plan.decode_delta(1) == plans.DELTA_FUSED_NORM
    assert plan.decode_lm_head(1, "greedy") == plans.HEAD_ARGMAX
    assert plan.decode_lm_head(1, "top-k") == plan.decode_lm_head(1, "penalized-top-k") == plans.HEAD_LOGITS
    assert not plan.prefill_pdl(1) and not plan.screened_lm_head_pdl and not plan.prefill_folded_norm(4096)
    assert resolve_plan(CONFIG, H200, Options(fused_delta_decode=False)).decode_delta(1) == plans.DELTA_UNFUSED
    assert resolve_plan(CONFIG, H200, Options(staged_out_projection_mlp=False)).decode_tail(1) == plans.TAIL_FUSED


def test_a_variant_the_device_or_dtype_cannot_serve_is_left_out_silently():
    assert not resolve_plan(CONFIG, H200, dtype=torch.float32).staged_tail  # the staged tail: bf16 only
    cpu = resolve_plan(CONFIG, DEVICES["cpu"])
    assert not cpu.staged_tail and not cpu.pdl and not cpu.cuda_graph and cpu.decode_tail(1) == plans.TAIL_FUSED


def test_an_option_the_device_cannot_take_is_refused_naming_it():
    with pytest.raises(ValueError, match="pdl=True needs an NVIDIA GPU of compute capability 9.0"):
        resolve_plan(CONFIG, DEVICES["cpu"], Options(pdl=True))
    with pytest.raises(TypeError, match="no_such_option"):
        Options(no_such_option=True)


def test_a_gpu_without_a_tuning_table_gets_the_default():
    other = plans.DeviceProperties("NVIDIA A100-SXM4-80GB", "cuda", (8, 0), 108, False)
    plan = resolve_plan(CONFIG, other)
    assert plan.tuning.name == "default" and not plan.pdl and not plan.staged_tail


def test_ops_prints_the_operator_table_and_the_plan(capsys):
    assert main(["ops", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "| # | operator |" in out and "Plan for hidden 1024, 24 layers on NVIDIA H200" in out
    decode = next(line for line in out.splitlines() if line.startswith("| out-projection + MLP |"))
    top_k = next(line for line in out.splitlines() if line.startswith("| LM head (top-k"))
    assert top_k.count("lm_head.screened_top_k") == 5 and top_k.count("lm_head logits") == 1  # 1 to 16 rows, 32
    assert decode.split(" | ")[1] == "linear.staged_out_projection_mlp:_staged_kernel"
    prefill = next(line for line in out.splitlines() if line.startswith("| PDL | projections"))
    assert prefill.count("projections, convs, attention") == 3  # 16, 128 and 256 tokens


def test_ops_shows_the_buckets_asked_for(capsys):
    assert main(["ops", "--gpu", "h200", "--rows", "3", "--tokens", "1500"]) == 0
    out = capsys.readouterr().out
    assert "| decode rows (bucket) | 4 |" in out and "| prefill tokens | 1500 |" in out
    assert "| gated delta rule | gated_delta_rule.chunk: chunks of 64, prepare (one kernel)" in out


def test_every_kernel_the_printed_plan_names_exists():
    import importlib
    import re

    text = "\n".join(resolve_plan(CONFIG, device).describe(CONFIG) for device in DEVICES.values())
    named = set(re.findall(r"([a-z_0-9]+\.[a-z_0-9]+):(_\w+)", text))
    assert len(named) >= 10
    for module, kernel in named:
        assert hasattr(importlib.import_module(f"qwen_triton.operators.{module}"), kernel), (module, kernel)
