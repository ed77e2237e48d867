"""`qwen-triton bench` end to end on the CPU at the tiny preset (Triton interpreted, two steps), so the
harness cannot rot: the JSON schema, the table and the plot."""

import json

import pytest

from qwen_triton.cli import main

# the Triton variants differ only on a GPU (split-K configs, CUDA graphs); one of them keeps CI short
VARIANTS = "transformers,reference,triton"


def test_bench_runs_end_to_end_on_the_cpu(tmp_path, capsys):
    code = main(["bench", "--device", "cpu", "--preset", "tiny", "--variants", VARIANTS, "--steps", "1",
                 "--prefill", "8", "--contexts", "4,12", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "latest.json").read_text())
    for key in ("gpu", "date", "commit", "torch", "triton", "hbm_copy_TBps", "matmul_TFLOPs", "results"):
        assert key in report
    assert "workloads" not in report  # only with --workloads (tests/benchmark/test_workloads.py)
    rows = report["results"]
    assert {r["variant"] for r in rows} == set(VARIANTS.split(","))
    for row in rows:
        assert set(row) >= {"variant", "phase", "context", "batch", "ms", "bytes", "flops", "pct_of_floor"}
        assert row["ms"] > 0 and row["pct_of_floor"] > 0
        assert (row["bytes"] if row["phase"] == "decode" else row["flops"]) > 0
    assert len([r for r in rows if r["phase"] == "decode"]) == 3 * 2
    assert (tmp_path / "latest.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "| triton |" in table and "decode @12 (us)" in table
    # the floors' byte and FLOP counts are printed, as the JSON holds them
    decode_bytes = {r["context"]: r["bytes"] for r in rows if r["phase"] == "decode"}
    assert f"Bytes per decode token: @4: {decode_bytes[4]:,}; @12: {decode_bytes[12]:,}." in table
    prefill_flops = next(r["flops"] for r in rows if r["phase"] == "prefill")
    assert f"FLOPs per prefill: 8 tokens: {prefill_flops:,}." in table
    # whether transformers ran with flash-linear-attention's kernels is said in the output, not only the JSON
    assert f"transformers: {report['notes']['transformers']}." in table and "flash-linear-attention" in table


def test_bench_defaults_on_the_cpu_write_outside_the_repository(tmp_path, capsys, monkeypatch):
    """Without --out the results go to the user's cache, never to the current directory (run from the
    repository's root, the committed results would be overwritten); file names are plain; a missing optional
    package skips its variant with a one-line note."""
    import qwen_triton.benchmark.harness as harness
    import qwen_triton.cli as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "DEFAULT_CACHE", tmp_path / "cache")
    real_find_spec = harness.importlib.util.find_spec
    monkeypatch.setattr(harness.importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real_find_spec(name, *a))
    assert main(["bench", "--device", "cpu", "--variants", "transformers,reference", "--steps", "1"]) == 0
    err = capsys.readouterr().err
    assert "note: skipping the transformers variant: transformers is not installed" in err
    written = sorted(p.name for p in (tmp_path / "cache" / "bench").iterdir())
    assert "latest.json" in written and not (tmp_path / "benchmarks").exists()
    dated = [name for name in written if name.endswith(".json") and name != "latest.json"]
    assert len(dated) == 1 and all(c.isalnum() or c in "._-" for c in dated[0]), dated
    report = json.loads((tmp_path / "cache" / "bench" / "latest.json").read_text())
    assert report["preset"] == "tiny" and {r["variant"] for r in report["results"]} == {"reference"}


def test_plan_options_parse_and_name_an_unknown_option():
    from qwen_triton.benchmark.harness import plan_options
    from qwen_triton.engine.plan import Options

    options = plan_options("split_k=False, pdl=None,prefill_pdl_tokens=128")
    assert options == dict(split_k=False, pdl=None, prefill_pdl_tokens=128)
    assert Options(**options).prefill_pdl_tokens == 128 and plan_options("") == {}
    with pytest.raises(SystemExit, match="no plan option 'nope'"):
        plan_options("nope=1")
