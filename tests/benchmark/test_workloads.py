"""`qwen-triton bench --workloads` end to end on the CPU at the CPU sizes (tiny preset, its vocabulary cut to 4,096;
Triton interpreted), run once for the module: the JSON's schema, every row's time and floor, the decode rows' batch
sizes and floors, the sampling and streaming ratios, the chat run's lengths and the printed table."""

import contextlib
import dataclasses
import io
import json
import statistics
from types import SimpleNamespace

import pytest

from qwen_triton.benchmark.floor import decode_run_bytes, prefill_flops
from qwen_triton.benchmark.workloads import (CPU_SIZES, GPU_SIZES, SAMPLING_SETTINGS, Workloads, run_workloads,
                                             sizes_for)
from qwen_triton.checkpoint import PRESETS, official_config
from qwen_triton.cli import main
from qwen_triton.config import parse_config
from tests.support import tiny_vocabulary

ROW_KEYS = {"workload", "case", "metric", "ms", "floor_ms", "pct_of_floor", "floor"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One bench run with the workload section (the variant part kept to the cheap reference at one step)."""
    out = tmp_path_factory.mktemp("bench")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), tiny_vocabulary():
        code = main(["bench", "--device", "cpu", "--workloads", "--variants", "reference", "--steps", "1",
                     "--prefill", "4", "--contexts", "4", "--out", str(out)])
        config = parse_config(official_config(PRESETS["tiny"]))
    report = json.loads((out / "latest.json").read_text())
    return SimpleNamespace(code=code, report=report, section=report["workloads"], table=printed.getvalue(),
                           config=config)


def rows_of(section, workload):
    return [r for r in section["rows"] if r["workload"] == workload]


@pytest.mark.slow
def test_the_section_and_its_rows(run):
    assert run.code == 0
    section = run.section
    assert set(section) >= {"preset", "device", "sizes_for", "sizes", "hbm_copy_TBps", "matmul_TFLOPs", "rows",
                            "chat", "seconds"}
    assert section["preset"] == "tiny" and section["sizes_for"] == "cpu"
    assert section["sizes"] == json.loads(json.dumps(dataclasses.asdict(CPU_SIZES)))
    # the ceilings are the bench's own, measured once
    assert section["hbm_copy_TBps"] == run.report["hbm_copy_TBps"] > 0
    assert section["matmul_TFLOPs"] == run.report["matmul_TFLOPs"] > 0
    assert {r["variant"] for r in run.report["results"]} == {"reference"}  # the variants ran as before
    counts = {w: len(rows_of(section, w)) for w in ("chat", "decode", "prefill", "sampling", "streaming")}
    assert counts == dict(chat=4, decode=len(CPU_SIZES.decode_batches), prefill=len(CPU_SIZES.prefill),
                          sampling=len(CPU_SIZES.sampling_batches) * len(SAMPLING_SETTINGS), streaming=2)
    assert len(section["rows"]) == sum(counts.values())
    ready = rows_of(section, "chat")[0]
    assert (ready["metric"], ready["floor"], ready["floor_ms"], ready["pct_of_floor"]) == ("ready in", "none", None,
                                                                                           None)
    assert ready["ms"] > 0 and ready["warm_up_s"] is None  # no warm-up on the CPU by default
    for row in section["rows"]:
        assert set(row) >= ROW_KEYS, row
        if row is ready:
            continue
        assert row["ms"] > 0 and row["floor_ms"] > 0, row
        assert row["pct_of_floor"] == pytest.approx(100 * row["floor_ms"] / row["ms"])
        assert row["floor"] == ("flops" if row["workload"] == "prefill" or "first token" in row["metric"]
                                else "bytes")


@pytest.mark.slow
def test_decode_rows_batches_and_floors(run):
    hbm = run.section["hbm_copy_TBps"]
    decode = rows_of(run.section, "decode")
    assert [r["batch"] for r in decode] == list(CPU_SIZES.decode_batches)
    for row in decode:
        assert 1 <= row["steps"] <= CPU_SIZES.decode_new_tokens - 1
        moved = decode_run_bytes(run.config, CPU_SIZES.decode_prompt, row["steps"], row["batch"]) / row["steps"]
        assert row["bytes"] == round(moved)
        assert row["floor_ms"] == pytest.approx(moved / (hbm * 1e12) * 1e3)
        assert row["tokens_per_s"] > 0
    # more rows move more bytes per step (each row's states and KV), the weights once
    assert decode[0]["bytes"] < decode[-1]["bytes"] < 2 * decode[0]["bytes"]


@pytest.mark.slow
def test_prefill_rows_floor_is_the_prompts_flops(run):
    matmul = run.section["matmul_TFLOPs"]
    for row, (count, length) in zip(rows_of(run.section, "prefill"), CPU_SIZES.prefill):
        assert (row["batch"], row["prompt_tokens"]) == (count, length)
        assert row["flops"] == count * prefill_flops(run.config, length)
        assert row["floor_ms"] == pytest.approx(row["flops"] / (matmul * 1e12) * 1e3)


@pytest.mark.slow
def test_sampling_and_streaming_ratios(run):
    sampling = rows_of(run.section, "sampling")
    for batch in CPU_SIZES.sampling_batches:
        rows = [r for r in sampling if r["batch"] == batch]
        assert [r["setting"] for r in rows] == [name for name, _ in SAMPLING_SETTINGS]
        assert [r["sampling"] for r in rows] == [settings for _, settings in SAMPLING_SETTINGS]
        greedy = rows[0]["ms"]
        for row in rows:
            assert row["ratio_to_greedy"] == pytest.approx(row["ms"] / greedy)
        assert rows[0]["ratio_to_greedy"] == 1.0
    stream, generate = rows_of(run.section, "streaming")
    assert stream["case"].startswith("stream") and generate["case"].startswith("generate")
    assert stream["ratio"] == pytest.approx(stream["ms"] / generate["ms"]) and generate["ratio"] == 1.0


@pytest.mark.slow
def test_chat_run_lengths_and_requests(run):
    chat = run.section["chat"]
    s = CPU_SIZES
    assert chat["sampling"] == dict(temperature=0.7, top_p=0.8, top_k=20)
    lengths = chat["lengths"]
    assert len(lengths) == len(set(lengths)) == s.chat_requests
    assert all(s.chat_lengths[0] <= n <= s.chat_lengths[1] for n in lengths)
    seen = {s.chat_warmup_length, s.decode_prompt, s.stream_prompt, *(n for _, n in s.prefill)}
    assert not seen & set(lengths)  # lengths the process has not run
    requests = chat["requests"]
    assert [r["prompt_tokens"] for r in requests] == lengths
    assert all(1 <= r["generated_tokens"] <= s.chat_new_tokens for r in requests)
    _, p50, worst, per_token = rows_of(run.section, "chat")
    ttft = [r["time_to_first_token_ms"] for r in requests]
    assert p50["ms"] == pytest.approx(statistics.median(ttft)) and worst["ms"] == max(ttft)
    assert worst["prompt_tokens"] == requests[ttft.index(max(ttft))]["prompt_tokens"]
    assert per_token["ms"] == pytest.approx(statistics.median(r["ms_per_token"] for r in requests
                                                              if r["ms_per_token"] is not None))


@pytest.mark.slow
def test_the_table_is_printed_with_every_row(run):
    table = run.table
    assert "| workload | case | measure | ms | floor (ms) | % of floor | notes |" in table
    for row in run.section["rows"]:
        assert f"| {row['workload']} | {row['case']} | {row['metric']} | {row['ms']:.3f} | " in table
    assert "| chat | LLM(...) without a warm-up | ready in | " in table
    assert "x greedy" in table and "x generate" in table


def test_sizes_by_device_and_the_llm_covers_them():
    assert sizes_for("cuda") is GPU_SIZES and sizes_for("cpu") is CPU_SIZES
    assert GPU_SIZES.decode_batches == (1, 2, 4, 8, 16, 32, 64, 128)
    assert GPU_SIZES.prefill == ((16, 128), (4, 1024)) and GPU_SIZES.sampling_batches == (1, 16)
    assert (GPU_SIZES.chat_requests, GPU_SIZES.chat_lengths, GPU_SIZES.chat_new_tokens) == (20, (32, 2048), 256)
    assert GPU_SIZES.max_batch() == 128 and GPU_SIZES.max_length() == 2048 + 256
    assert CPU_SIZES.max_length() == 24 + 2 and CPU_SIZES.max_batch() == 2


def test_steps_counts_the_tokens_generated():
    """A row stopped at an end-of-turn id took a step for it; the steps run until the last row finished."""
    def result(tokens, finish):
        return SimpleNamespace(token_ids=[0] * tokens, finish_reason=finish)

    assert Workloads.steps([result(4, "length")]) == 3
    assert Workloads.steps([result(2, "stop"), result(4, "length")]) == 3
    assert Workloads.steps([result(4, "stop"), result(4, "length")]) == 4
    assert Workloads.steps([result(0, "stop")]) == 0


def test_ops_and_workloads_together_are_refused(capsys):
    assert main(["bench", "--device", "cpu", "--ops", "--workloads"]) == 2
    assert "--ops and --workloads" in capsys.readouterr().err


def test_a_subset_of_the_workloads_is_chosen_by_name(capsys, monkeypatch):
    assert main(["bench", "--device", "cpu", "--workloads", "decode,dance"]) == 2
    assert "--workloads: unknown dance" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown workloads"):
        run_workloads("tiny", "cpu", which=("nap",))
    ran = []
    monkeypatch.setattr(Workloads, "__init__", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(Workloads, "close", lambda self: None)
    for name in ("chat", "decode", "prefill", "sampling", "streaming"):
        monkeypatch.setattr(Workloads, name, lambda self, name=name: ran.append(name))
    monkeypatch.setattr(Workloads, "rows", [], raising=False)
    section = run_workloads("tiny", "cpu", which=("sampling", "decode"), hbm=1.0, matmul=1.0)
    assert ran == ["decode", "sampling"] and section["which"] == ["sampling", "decode"] and section["chat"] is None
