"""`qwen-triton bench --serve` on the CPU at its CPU sizes (a server process over the tiny preset's random checkpoint,
the reference backend, concurrency 1 and 2, three ids a request): every request succeeds, the JSON's serve section
holds each level's measures and floors, the table is printed, the server stops cleanly; the same load against a
server given by --url; the statistics on hand-made streams; the flags' checks."""

import contextlib
import io
import json
from types import SimpleNamespace

import pytest
import torch

from qwen_triton import LLM
from qwen_triton.benchmark.floor import decode_bytes, prefill_flops
from qwen_triton.benchmark.serve_load import (CPU_SIZES, SERVER_MEANS, SERVER_PAUSES, level_prompts, percentile,
                                              run_serve_load, server_means, summarize)
from qwen_triton.checkpoint import PRESETS, official_config
from qwen_triton.cli import default_model, main
from qwen_triton.config import parse_config
from qwen_triton.server.app import create_app
from qwen_triton.server.runner import BackgroundServer

TINY = parse_config(official_config(PRESETS["tiny"]))
LEVEL_KEYS = {"concurrency", "sent", "succeeded", "failed", "first_error", "duration_s", "output_tokens",
              "output_tokens_per_s", "per_token_ms_p50", "per_token_ms_p99", "request_per_token_ms_p50", "ttft_ms_p50",
              "ttft_ms_p99", "floor", "pct_of_floor", "requests", "prompt_tokens"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve-bench")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "--device", "cpu", "--serve", "--variants", "reference", "--steps", "1", "--prefill", "4",
                     "--contexts", "4", "--out", str(out)])
    report = json.loads((out / "latest.json").read_text())
    return SimpleNamespace(code=code, report=report, section=report["serve"], table=printed.getvalue(), out=out)


def test_every_request_succeeds_and_each_level_has_its_measures_and_floors(run):
    assert run.code == 0
    section = run.section
    assert section["sizes_for"] == "cpu" and section["preset"] == "tiny" and section["started_server"]
    assert section["server_exit_status"] == 0  # SIGTERM: drained, exit 0
    assert section["hbm_copy_TBps"] == run.report["hbm_copy_TBps"] and {r["variant"] for r in run.report["results"]} \
        == {"reference"}
    assert [level["concurrency"] for level in section["levels"]] == [1, 2]
    for level in section["levels"]:
        assert set(level) >= LEVEL_KEYS and "target" not in level  # issue 35's targets: the H200's, the 0.8B's
        requests = level["concurrency"] * CPU_SIZES.requests_per_client
        assert level["sent"] == level["succeeded"] == requests and level["failed"] == 0, level["first_error"]
        assert level["output_tokens"] == requests * CPU_SIZES.output_tokens
        assert all(r["tokens"] == CPU_SIZES.output_tokens and r["error"] is None for r in level["requests"])
        low, high = CPU_SIZES.prompt_lengths
        assert all(low <= length <= high for length in level["prompt_tokens"])
        assert level["output_tokens_per_s"] == pytest.approx(level["output_tokens"] / level["duration_s"])
        assert 0 < level["ttft_ms_p50"] <= level["ttft_ms_p99"] and 0 < level["per_token_ms_p50"]
        floor = level["floor"]
        step_ms = decode_bytes(TINY, floor["decode_context"], batch=level["concurrency"]).total / (
            section["hbm_copy_TBps"] * 1e12) * 1e3
        assert floor["per_token_ms"] == pytest.approx(step_ms)
        assert floor["output_tokens_per_s"] == pytest.approx(level["concurrency"] / (step_ms * 1e-3))
        median = round(percentile(level["prompt_tokens"], 0.5))
        assert floor["ttft_ms_p50"] == pytest.approx(prefill_flops(TINY, median) / (section["matmul_TFLOPs"] * 1e12)
                                                     * 1e3)
        assert level["pct_of_floor"]["per_token_ms_p50"] == pytest.approx(100 * step_ms / level["per_token_ms_p50"])
    assert "| 1 | 2 / 2 |" in run.table and "| 2 | 4 / 4 |" in run.table
    assert (run.out / "serve-server.log").read_text().count("qwen-triton: stopped") == 1


def test_the_load_against_a_server_given_by_url_from_client_processes(monkeypatch):
    """--url: no server started; the two clients in two processes of their own (one client a process here)."""
    monkeypatch.setattr("qwen_triton.benchmark.serve_load.CLIENTS_PER_PROCESS", 1)
    llm = LLM(default_model("cpu"), backend="reference", device="cpu", dtype=torch.float32, max_length=64, max_batch=2)
    sizes = CPU_SIZES.__class__(concurrencies=(2,), prompt_lengths=(3, 5), output_tokens=2, requests_per_client=2)
    with BackgroundServer(create_app(llm, model_name="given")) as server:
        section = run_serve_load("tiny", "cpu", hbm=1.0, matmul=1.0, sizes=sizes, url=server.url)
        served = server.app.state.scheduler.statistics.finished
    (level,) = section["levels"]
    assert not section["started_server"] and section["url"] == server.url
    assert (level["sent"], level["succeeded"], level["output_tokens"]) == (4, 4, 8)
    assert served == 2 + 4  # the warm-up's requests, then the level's
    # the server's own split of the level, from its /metrics: the first id's wait splits at the slot
    server = level["server"]
    assert server["time_to_first_token_ms_mean"] > 0 and server["step_ms_mean"] > 0
    assert server["time_to_first_token_ms_mean"] == pytest.approx(
        server["queue_time_ms_mean"] + server["prefill_time_ms_mean"], rel=1e-6)
    assert 1 <= server["decode_batch_size_mean"] <= 2
    pauses = server["gc_pauses_server_process"]
    assert pauses["count"] >= pauses["over_10_ms"] >= 0 and pauses["total_ms"] >= 0


def test_the_servers_means_are_over_the_level_alone():
    before = {**{key: (1.0, 4) for key in SERVER_MEANS}, **{key: (0.5, 10, 9) for key in SERVER_PAUSES}}
    after = {**{key: (1.5, 6) for key in SERVER_MEANS}, **{key: (0.75, 13, 10) for key in SERVER_PAUSES}}
    means = server_means(before, after)
    assert means["time_to_first_token_ms_mean"] == pytest.approx(250.0)  # 0.5 s over 2 observations
    assert means["decode_batch_size_mean"] == pytest.approx(0.25)
    # 3 pauses of 250 ms in all, 2 of them past 10 ms
    assert means["gc_pauses_engine_process"] == dict(count=3, total_ms=pytest.approx(250.0), over_10_ms=2)
    assert server_means(None, after) is None
    assert server_means(before, before)["queue_time_ms_mean"] is None  # nothing observed


def test_a_chunk_of_several_ids_counts_as_many_gaps():
    records = [dict(prompt_tokens=4, sent=0.0, first=0.010, ended=0.040, tokens=3, gaps=[0.010, 0.010], error=None),
               dict(prompt_tokens=6, sent=0.005, first=0.020, ended=0.050, tokens=2, gaps=[0.030], error=None),
               dict(prompt_tokens=5, sent=0.01, first=None, ended=0.02, tokens=0, gaps=[], error="HTTP 429: full")]
    level = summarize(records, 2)
    assert (level["sent"], level["succeeded"], level["failed"], level["first_error"]) == (3, 2, 1, "HTTP 429: full")
    assert level["output_tokens"] == 5 and level["duration_s"] == pytest.approx(0.05)
    assert level["per_token_ms_p50"] == pytest.approx(10.0) and level["ttft_ms_p50"] == pytest.approx(12.5)
    assert level["request_per_token_ms_p50"] == pytest.approx(20.0)  # the requests' means: 10 and 30 ms
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5 and percentile([], 0.5) is None


def test_prompts_are_seeded_and_within_the_lengths():
    first = level_prompts(CPU_SIZES, 3, 1000, 2, seed=7)
    assert first == level_prompts(CPU_SIZES, 3, 1000, 2, seed=7) != level_prompts(CPU_SIZES, 3, 1000, 2, seed=8)
    assert len(first) == 3 and all(len(own) == 2 for own in first)
    assert all(4 <= len(prompt) <= 12 and max(prompt) < 1000 for own in first for prompt in own)


@pytest.mark.parametrize("arguments, message", [
    (["--serve", "--concurrency", "0"], "--concurrency must be positive"),
    (["--serve", "--prompt-lengths", "9,3"], "--prompt-lengths takes LOW,HIGH with LOW <= HIGH"),
    (["--serve", "--output-tokens", "0"], "--output-tokens must be >= 1"),
    (["--serve", "--url", "127.0.0.1:8000"], "--url takes the server's root"),
    (["--url", "http://127.0.0.1:8000"], "--url is for --serve"),
    (["--ops", "--serve"], "--ops and --serve are separate runs"),
])
def test_bad_serve_flags_are_one_line(arguments, message, capsys):
    assert main(["bench", "--device", "cpu", *arguments]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err
