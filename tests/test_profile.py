"""`qwen-triton profile` end to end on the CPU (tiny preset with a vocabulary of 4,096, interpreter, operators timed on
the host)."""

import pytest
import torch

from qwen_triton.benchmark.floor import decode_bytes
from qwen_triton.benchmark.profile import format_profile, run_profile
from qwen_triton.checkpoint import PRESETS, official_config
from qwen_triton.config import FULL_ATTENTION, parse_config
from qwen_triton.engine.trace import KernelTrace
from qwen_triton.operators.lm_head.screened import screened_lm_head_bytes
from tests.support import tiny_vocabulary


@pytest.fixture(scope="module", autouse=True)
def small_vocabulary():
    with tiny_vocabulary():
        yield


@pytest.fixture(scope="module")
def report():
    return run_profile(preset="tiny", context=5, prefill_tokens=8, steps=1, device="cpu")


def test_profile_names_every_operator_of_each_layer(report):
    config = parse_config(official_config(PRESETS["tiny"]))
    attention = sum(t == FULL_ATTENTION for t in config.layer_types)
    delta = len(config.layer_types) - attention
    counts = {row["kind"]: row["count"] for row in report["decode"]["by_kind"]}
    assert counts == {
        "embedding": 1,
        "attention in-projection": attention,
        "q/k norm + rotary + KV write": attention,
        "attention (split-KV decode + merge)": attention,
        "attention gate + out-projection + residual + MLP": attention,
        # one sequence: in-projection and step in one kernel; its gated norm in the out-projection's prologue
        "deltanet in-projection + step (conv, gating, delta rule)": delta,
        "deltanet gated norm + out-projection + residual + MLP": delta,
        "final norm + lm head (int8 screen, exact check) + argmax": 1,  # greedy, one sequence
        "feedback: chosen ids -> next inputs": 1,
    }
    prefill_kinds = {row["kind"] for row in report["prefill"]["by_kind"]}
    assert {"attention (flash prefill)", "gated delta rule (chunked) + gated norm", "deltanet conv + silu",
            "mlp norm + gate/up + swiglu", "mlp down-projection + residual"} <= prefill_kinds
    assert all(op["us"] > 0 for op in report["decode"]["operators"] + report["prefill"]["operators"])
    text = format_profile(report)
    assert "decode step at context 5" in text and "prefill of 8 tokens" in text
    assert "share of the span (us)" in text
    for part in ("decode", "prefill"):
        shares = sum(row["span_share_us"] for row in report[part]["by_kind"])
        assert abs(shares - report[part]["span_us"]) <= 0.05 * report[part]["span_us"]


def test_profile_bytes_add_up_to_the_decode_floor(report):
    # the operators' own counts (weights from the tensors, states, KV cache at the context) against the
    # floor counted from the config: equal but for the norm weights and the activations
    config = parse_config(official_config(PRESETS["tiny"]))
    counted = sum(op["bytes"] for op in report["decode"]["operators"])
    floor = decode_bytes(config, 5, weight_bytes=4, activation_bytes=4).total  # float32 on the CPU
    # the greedy step's LM head reads its int8 copy (screened_lm_head_bytes), not the float32 head
    floor += screened_lm_head_bytes(config.vocab_size, config.hidden_size) - config.vocab_size * config.hidden_size * 4
    assert abs(counted - floor) / floor < 0.02  # 1.2% of the 4,096-row vocabulary's step


def test_kernel_trace_assigns_launches_to_the_current_operator():
    trace = KernelTrace()

    class Launch:
        def __init__(self, name):
            self.name = name

        def get(self):
            return {"name": self.name}

    trace._hook(Launch("before"))
    with trace.operator("outer", 0, 10, 20):
        trace._hook(Launch("a"))
        with trace.operator("inner", 0, 1, 2):
            trace._hook(Launch("b"))
        trace._hook(Launch("c"))
    assert trace.unlabelled == ["before"]
    assert [(op.kind, name) for op, name in trace.launches()] == [("outer", "a"), ("inner", "b"), ("outer", "c")]


def test_the_profile_reports_the_autotuned_configs_that_ran(monkeypatch):
    import triton

    from qwen_triton.benchmark.profile import format_profile
    from qwen_triton.operators.common import autotune_choices
    from qwen_triton.operators.gated_delta_rule import chunk
    from qwen_triton.operators.linear import gemm

    config = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "SPLIT_K": 4}, num_warps=4,
                           num_stages=3)
    capped = triton.Config({}, num_warps=4, num_stages=3, maxnreg=168)
    monkeypatch.setattr(gemm._gemm_split, "cache", {(128, 1024, 3584, "torch.bfloat16"): config})
    monkeypatch.setattr(chunk._chunk_inverse_kernel, "cache", {(64, 128, 64, "tf32"): capped})
    choices = autotune_choices()
    expected = dict(kernel="linear.gemm:_gemm_split", key=["128", "1024", "3584", "torch.bfloat16"],
                    config=dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, SPLIT_K=4), num_warps=4,
                    num_stages=3, maxnreg=None)
    assert expected in choices
    assert sum(choice["kernel"] == "linear.gemm:_gemm_split" for choice in choices) == 1
    empty = dict(span_us=0.0, kernel_count=0, kernel_us=0.0, gap_us=0.0, floor_us=0.0, pct_of_floor=0.0, by_kind=[],
                 timeline="host")
    report = dict(device="cpu", hbm_copy_TBps=1.0, matmul_TFLOPs=1.0, decode=dict(empty, context=5),
                  prefill=dict(empty, tokens=8), autotune_choices=choices)
    assert ("| linear.gemm:_gemm_split | 128, 1024, 3584, torch.bfloat16 | BLOCK_M 64, BLOCK_N 64, BLOCK_K 128, "
            "GROUP_M 8, SPLIT_K 4, 4 warps, 3 stages |") in format_profile(report)
    assert ("| gated_delta_rule.chunk:_chunk_inverse_kernel | 64, 128, 64, tf32 | , 4 warps, 3 stages, at most 168 "
            "registers |") in format_profile(report)


def test_profile_of_several_rows_and_prompts_runs_the_batched_kernels():
    report = run_profile(preset="tiny", context=5, prefill_tokens=8, steps=1, device="cpu", rows=3, prompts=2)
    kinds = {row["kind"] for row in report["decode"]["by_kind"]}
    assert report["decode"]["rows"] == 3 and report["prefill"]["prompts"] == 2
    # several rows: the projections run the GEMM, not the one-row fused in-projection + step
    assert "deltanet in-projection + step (conv, gating, delta rule)" not in kinds
    text = format_profile(report)
    assert "decode step at context 5, 3 rows" in text and "prefill of 8 tokens, 2 prompts" in text
    # two prompts: one packed pass over both, each layer's operators once
    config = parse_config(official_config(PRESETS["tiny"]))
    attention = sum(t == FULL_ATTENTION for t in config.layer_types)
    counts = {row["kind"]: row["count"] for row in report["prefill"]["by_kind"]}
    assert counts["gated delta rule (chunked, packed) + gated norm"] == len(config.layer_types) - attention
    assert counts["attention (flash prefill, packed)"] == attention and counts["each sequence's last row"] == 1


def test_profile_of_a_sampled_step_runs_the_sampling_kernels():
    """--temperature/--top-k/--top-p/--presence-penalty: the step's rows sample, its kernels those of that mode."""
    from qwen_triton.benchmark.models import random_llm
    from qwen_triton.benchmark.profile import profile_decode
    from qwen_triton.engine.sampling import SamplingParams

    model = random_llm("tiny", "triton", device="cpu", dtype=torch.float32, max_length=8, warm_up=False).model
    sampling = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)
    decode = profile_decode(model, 5, 1, 1.0, 1.0, params=sampling)
    assert decode["mode"] == "penalized-top-k"
    assert "penalties: count the chosen ids" in {row["kind"] for row in decode["by_kind"]}
    greedy = profile_decode(model, 5, 1, 1.0, 1.0)
    assert greedy["mode"] == "greedy" and "penalties: count the chosen ids" not in {
        row["kind"] for row in greedy["by_kind"]}
    text = format_profile(dict(device="cpu", hbm_copy_TBps=1.0, matmul_TFLOPs=1.0, decode=decode,
                               prefill=dict(greedy, tokens=8)))
    assert "decode step at context 5, penalized-top-k mode" in text
