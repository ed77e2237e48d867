"""Compile workers (engine/compile_workers.py) and the warm-up's shares (engine/warmup.py).

On the CPU: the shares divide the warm-up's items and its launches (every compile identity and autotuner key of the
whole warm-up is met by some share, none other), the marker's key and its effect, the count of workers, and that a
worker that fails, hangs or cannot start never fails the caller; a real worker process runs its share of a tiny
model under the interpreter. On a GPU: `LLM(...)` on a fresh Triton cache with workers, again on that cache (no
workers: the marker) and without workers generate the same greedy ids."""

from __future__ import annotations

import dataclasses
import json
import sys
import types

import pytest
import torch

from qwen_triton.benchmark.models import random_weights
from qwen_triton.checkpoint import official_config
from qwen_triton.config import parse_config
from qwen_triton.engine import compile_workers, warmup
from qwen_triton.engine.triton_model import TritonModel
from tests.engine.test_warmup import LaunchRecorder
from tests.support import run_without_interpreter, small_config

ONE_LAYER = dict(num_hidden_layers=1, layer_types=["linear_attention"])  # (a share of its warm-up: seconds)


def _config(**overrides):
    return parse_config(official_config(small_config(**overrides)))


def _model(max_length: int = 70, max_batch: int = 3, dtype=torch.bfloat16, **options) -> TritonModel:
    config = _config()
    return TritonModel(config, random_weights(config, "cpu", dtype), max_batch=max_batch, max_length=max_length,
                       device="cpu", dtype=dtype, **options)


# ---- the shares ---------------------------------------------------------------------------------------------------
def test_the_items_are_the_warm_up_in_its_order_and_the_shares_partition_them():
    model = _model()
    contents = warmup.Contents.of(model)
    items, _ = warmup.warm_up_items(model)
    names = [item.name for item in items]
    buckets = sorted({1 << (tokens - 1).bit_length() for tokens in contents.prefill_lengths})
    expected = [f"prefill of {tokens} tokens in slot {slot}" for length_bucket in buckets
                for tokens in contents.prefill_lengths if 1 << (tokens - 1).bit_length() == length_bucket
                for slot in contents.prefill_slots]
    expected += [f"packed prefill of {tokens} tokens" for tokens in contents.packed_tokens]
    expected += [f"packed LM head of {rows} rows" for rows in contents.packed_rows]
    expected += [f"first token's choice, {mode}, row {row}" for mode, _, params in warmup.DECODE_MODES
                 if params is not None for row in contents.first_token_rows]
    expected += [f"decode step of batch {size}, {mode}" for size in contents.batches
                 for mode, _, _ in warmup.DECODE_MODES]
    assert names == expected and len(set(names)) == len(names)
    assert contents.batches == (1, 2, 3) and len(contents.packed_tokens) == 2  # (each phase has items to divide)
    assert [item.name for item in warmup.share_of(items, None)] == names
    assert [item.name for item in warmup.warm_up_items(model)[0]] == names  # deterministic
    for count in (1, 2, 3, 8, len(items) + 1):
        shares = [[item.name for item in warmup.share_of(items, (index, count))] for index in range(count)]
        assert sorted(name for share in shares for name in share) == sorted(names)  # each in exactly one share
        assert max(map(len, shares)) - min(map(len, shares)) <= 1  # even shares
    for bad in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="share must be"):
            warmup.share_of(items, bad)


def test_the_shares_launch_together_every_kernel_and_key_of_the_whole_warm_up(monkeypatch):
    """What decides the compiles and the tunings, per launch (test_warmup.LaunchRecorder, kernels not run): the
    shares' union is the whole warm-up's, including a share that ran no prefill (its first-token choices then read
    zeros of the logits' shape). Each share on a model of its own, as each worker builds one (a model makes its
    decode attention's pick once, at its first decode step)."""
    recorder = LaunchRecorder(dry=True)
    recorder.install(monkeypatch)
    whole = warmup.warm_up(_model())
    assert whole.share is None and whole.compile_workers == 0
    identities, keys = recorder.since((0, 0))
    count = 3
    shared_identities, shared_keys = set(), set()
    for index in range(count):
        mark = recorder.mark()
        report = warmup.warm_up(_model(), share=(index, count))
        assert report.share == (index, count) and report.summary().startswith(f"warm-up (share {index + 1} of 3): ")
        assert dataclasses.replace(report, seconds=whole.seconds, share=None) == whole  # the whole warm-up's contents
        share_identities, share_keys = recorder.since(mark)
        shared_identities |= share_identities
        shared_keys |= share_keys
    assert shared_keys == keys and shared_identities == identities
    items, _ = warmup.warm_up_items(_model())
    first_choice = next(index for index, item in enumerate(items) if item.phase == "first token")
    mark = recorder.mark()
    warmup.warm_up(_model(), share=(first_choice, len(items)))  # one choice alone, from zeros
    alone_identities, alone_keys = recorder.since(mark)
    assert alone_keys <= keys and alone_identities <= identities
    assert any("sampling" in name for name, *_ in alone_identities)


# ---- the marker ---------------------------------------------------------------------------------------------------
def test_the_marker_key_changes_with_each_of_its_inputs(tmp_path):
    identity = compile_workers.Identity.of(_model())
    assert identity == compile_workers.Identity.of(_model())  # two equal models, one identity
    assert identity.gpu == "cpu" and identity.picks == "none" and identity.max_length == 70
    assert identity.key() == compile_workers.Identity.of(_model()).key()
    changed = {"package": "0.1.1+x", "triton": "3.7.0", "torch": "2.14.0", "gpu": "NVIDIA H100 80GB HBM3",
               "config": repr(_config(vocab_size=302)), "dtype": str(torch.float16),
               "plan": repr(_model(cuda_graph=False).plan), "picks": "ab", "max_length": 71, "max_batch": 4}
    assert set(changed) == {field.name for field in dataclasses.fields(compile_workers.Identity)}
    for name, value in changed.items():
        assert value != getattr(identity, name), name
        assert dataclasses.replace(identity, **{name: value}).key() != identity.key(), name
    # the identity of a model reflects its inputs
    assert compile_workers.Identity.of(_model(max_batch=4)).max_batch == 4
    assert compile_workers.Identity.of(_model(dtype=torch.float32)).dtype == "torch.float32"
    assert compile_workers.Identity.of(_model(packed_prefill=False)).plan != identity.plan

    assert not compile_workers.is_warm(identity, tmp_path)
    compile_workers.mark_warm(identity, tmp_path)
    assert compile_workers.is_warm(identity, tmp_path)
    path = compile_workers.marker_path(identity, tmp_path)
    assert path.parent == tmp_path / "qwen-triton-warm" and json.loads(path.read_text())["max_batch"] == 3
    assert not compile_workers.is_warm(dataclasses.replace(identity, max_batch=4), tmp_path)


def test_the_source_digest_follows_the_package_files(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "picks").mkdir()
    (tmp_path / "picks" / "gpu.json").write_text("{}")
    monkeypatch.setattr(compile_workers, "PACKAGE", tmp_path)
    first = compile_workers.source_digest()
    (tmp_path / "notes.txt").write_text("not a source file")
    assert compile_workers.source_digest() == first
    (tmp_path / "picks" / "gpu.json").write_text('{"picks": []}')
    assert compile_workers.source_digest() != first


class _Recorded:
    """warm_up's collaborators, faked: the warm-up itself and the workers, each call recorded."""

    def __init__(self, monkeypatch, fail: bool = False):
        self.started: list[int] = []
        self.warmed: list[tuple] = []

        def compile_in_workers(model, count, progress=False):
            self.started.append(count)
            if fail:
                raise RuntimeError("no processes today")

        def warm_up(model, progress=False, compiled=(0, 0.0)):
            self.warmed.append(compiled)
            return "report"

        monkeypatch.setattr(compile_workers, "compiles_to_disk", lambda model: True)
        monkeypatch.setattr(compile_workers, "worker_count", lambda model: 2)
        monkeypatch.setattr(compile_workers, "compile_in_workers", compile_in_workers)
        monkeypatch.setattr(compile_workers.warmup, "warm_up", warm_up)


def test_the_marker_makes_the_next_warm_up_warm(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    recorded = _Recorded(monkeypatch)
    model = _model()
    assert compile_workers.warm_up(model) == "report"
    assert recorded.started == [2] and recorded.warmed[0][0] == 2
    assert compile_workers.is_warm(compile_workers.Identity.of(model))  # in TRITON_CACHE_DIR
    assert compile_workers.warm_up(model) == "report"
    assert recorded.started == [2] and recorded.warmed[1] == (0, 0.0)  # warm: no workers
    compile_workers.warm_up(_model(max_batch=4))  # another shape: cold
    assert recorded.started == [2, 2]


def test_the_cpu_warm_up_starts_no_worker_and_writes_no_marker(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_workers, "compile_in_workers", lambda *args, **kwargs: pytest.fail("started"))
    monkeypatch.setattr(compile_workers.warmup, "warm_up", lambda model, progress=False, compiled=(0, 0.0): compiled)
    assert compile_workers.warm_up(_model()) == (0, 0.0)
    assert not (tmp_path / compile_workers.MARKERS).exists()


# ---- how many -----------------------------------------------------------------------------------------------------
def test_the_worker_count_rule(monkeypatch):
    monkeypatch.delenv(compile_workers.WORKERS_VARIABLE, raising=False)
    assert compile_workers.worker_count(_model()) == 0  # the CPU: nothing compiles
    gpu_model = types.SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr("qwen_triton.operators.common.interpreting", lambda: True)
    assert compile_workers.worker_count(gpu_model) == 0  # a GPU under the interpreter: nothing compiles either

    monkeypatch.setattr(compile_workers.os, "cpu_count", lambda: 16)
    assert compile_workers.requested_workers() == 8
    monkeypatch.setattr(compile_workers.os, "cpu_count", lambda: 6)
    assert compile_workers.requested_workers() == 3
    for value, count in (("0", 0), ("5", 5), (" 12 ", 12)):
        assert compile_workers.requested_workers({compile_workers.WORKERS_VARIABLE: value}) == count
    for value in ("-1", "two", "1.5"):
        with pytest.raises(ValueError, match="QWEN_TRITON_COMPILE_WORKERS must be a count"):
            compile_workers.requested_workers({compile_workers.WORKERS_VARIABLE: value})

    gib = 1 << 30
    assert compile_workers.workers_that_fit(8, 100 * gib, 10 * gib) == 8
    assert compile_workers.workers_that_fit(8, 50 * gib, 10 * gib) == 4  # nine tenths of the free memory
    assert compile_workers.workers_that_fit(8, 20 * gib, 10 * gib) == 0  # one would fit: not worth it
    assert compile_workers.workers_that_fit(1, 100 * gib, gib) == 0

    # on a GPU (faked): the request, limited by the free memory at 1.5 x what this process allocated + 1.5 GiB each
    monkeypatch.setattr(compile_workers, "compiles_to_disk", lambda model: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 6 * gib)
    assert compile_workers.worker_bytes(gpu_model) == 9 * gib + gib + gib // 2
    assert compile_workers.worker_count(gpu_model) == 3  # 3 (the CPUs) of the 5 that fit
    monkeypatch.setenv(compile_workers.WORKERS_VARIABLE, "8")
    assert compile_workers.worker_count(gpu_model) == 5
    monkeypatch.setenv(compile_workers.WORKERS_VARIABLE, "0")
    assert compile_workers.worker_count(gpu_model) == 0
    monkeypatch.setenv(compile_workers.WORKERS_VARIABLE, "8")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 30 * gib)
    assert compile_workers.worker_count(gpu_model) == 0


# ---- failures never fail the caller -------------------------------------------------------------------------------
def test_a_worker_that_fails_or_hangs_is_reported_and_the_caller_goes_on(monkeypatch, capsys):
    model = _model(max_length=4, max_batch=1)
    monkeypatch.setattr(compile_workers, "WORKER_COMMAND",
                        (sys.executable, "-c", "import sys; sys.stdin.buffer.read(); print('no luck'); sys.exit(3)"))
    workers = compile_workers.compile_in_workers(model, 2, progress=True)
    assert [worker.failure for worker in workers] == ["exit code 3"] * 2
    printed = capsys.readouterr().err
    assert "compile worker 1 of 2 failed (exit code 3)" in printed and "no luck" in printed
    assert "warm-up: 2 compile workers: 2/2" in printed and "warm-up: 0 of 2 compile workers done" in printed

    monkeypatch.setattr(compile_workers, "WORKER_COMMAND", (sys.executable, "-c", "import time; time.sleep(60)"))
    workers = compile_workers.compile_in_workers(model, 2, timeout=0.5)
    assert all(worker.failure == "still running after 0.5 s: stopped" for worker in workers)
    assert all(worker.process.returncode is not None for worker in workers)  # stopped, not left behind
    assert "compile worker 2 of 2 failed (still running after 0.5 s: stopped)" in capsys.readouterr().err

    monkeypatch.setattr(compile_workers, "WORKER_COMMAND", ("/nonexistent/python",))
    assert compile_workers.compile_in_workers(model, 2) == []
    assert "compile workers could not start" in capsys.readouterr().err


def test_workers_that_raise_do_not_fail_the_warm_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    recorded = _Recorded(monkeypatch, fail=True)
    assert compile_workers.warm_up(_model()) == "report"
    assert recorded.started == [2] and len(recorded.warmed) == 1
    assert "compile workers failed (RuntimeError: no processes today)" in capsys.readouterr().err


def test_a_worker_process_that_raises_reports_its_error(tmp_path, capsys):
    """The real entry point, on a task that cannot build its model (an unknown plan option)."""
    task = compile_workers.Task(_config(**ONE_LAYER), torch.float32, {"no_such_option": True}, 4, 1, "cpu", (1, 2))
    worker = compile_workers.start_worker(task, tmp_path / "worker.log")
    compile_workers.wait_for([worker], timeout=120)
    assert worker.failure == "exit code 1"
    assert "unexpected keyword argument 'no_such_option'" in capsys.readouterr().err


# ---- the worker's own work ----------------------------------------------------------------------------------------
def test_a_worker_keeps_the_autotuners_results_off_the_disk(monkeypatch):
    """Under the interpreter no autotuner caches anyway; switched on here, the worker switches every one off."""
    from qwen_triton.operators.common import autotuners

    tuners = autotuners()
    for tuner in tuners.values():
        monkeypatch.setattr(tuner, "cache_results", True)
    task = compile_workers.Task(_config(**ONE_LAYER), torch.float32, {}, 4, 1, "cpu", (0, 100))  # its first item
    report = compile_workers.run_task(task)
    assert report.share == (0, 100) and report.prefill_lengths == (1, 2, 4)
    assert not any(tuner.cache_results for tuner in tuners.values())


@pytest.mark.slow
def test_a_worker_process_runs_its_share(tmp_path, monkeypatch):
    """The entry point in a process of its own (`python -m qwen_triton.engine.compile_workers`, a pickled Task on
    stdin), a one-layer model under the interpreter, share (0, 2), into the parent's TRITON_CACHE_DIR."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    task = compile_workers.Task(_config(**ONE_LAYER), torch.float32, {"packed_prefill": False}, 4, 1, "cpu", (0, 2))
    worker = compile_workers.start_worker(task, tmp_path / "worker.log")
    compile_workers.wait_for([worker], timeout=120)
    printed = (tmp_path / "worker.log").read_text()
    assert worker.failure is None, printed
    assert "warm-up (share 1 of 2): 3 prefill lengths" in printed and str(tmp_path / "cache") in printed


# ---- GPU: the same ids with and without workers; a warm start starts none --------------------------------------------
START = """
import json, os, sys
os.environ["TRITON_CACHE_DIR"] = sys.argv[1]
os.environ["QWEN_TRITON_COMPILE_WORKERS"] = sys.argv[2]
from qwen_triton.benchmark.models import random_llm
from qwen_triton.tokenizer import Tokenizer
llm = random_llm("0.8b", max_length=600, max_batch=4, warm_up=True, progress=True, tokenizer=Tokenizer.default())
prompts = [[(7 * i + 13 * row) % 248000 for i in range(length)] for row, length in enumerate((5, 70, 300, 513))]
ids = [result.token_ids for result in llm.generate(prompts, max_new_tokens=16)]
print(json.dumps(dict(ids=ids, workers=llm.warm_up_report.compile_workers, seconds=llm.warm_up_report.seconds)))
"""


@pytest.mark.gpu
def test_gpu_workers_change_no_id_and_a_warm_start_starts_none(tmp_path):
    script = START + "\n"
    with_workers = run_without_interpreter(
        f"import sys; sys.argv = ['', {str(tmp_path / 'a')!r}, '2']\n" + script)
    again = run_without_interpreter(f"import sys; sys.argv = ['', {str(tmp_path / 'a')!r}, '2']\n" + script)
    without = run_without_interpreter(f"import sys; sys.argv = ['', {str(tmp_path / 'b')!r}, '0']\n" + script)
    print(f"\nwarm-up on a fresh cache with workers {with_workers['seconds']:.1f} s, again {again['seconds']:.1f} s, "
          f"without workers {without['seconds']:.1f} s")
    assert with_workers["workers"] == 2 and again["workers"] == 0 and without["workers"] == 0
    assert with_workers["ids"] == again["ids"] == without["ids"]
    assert any((tmp_path / "a" / compile_workers.MARKERS).iterdir())
