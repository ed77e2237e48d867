"""Recorded autotuner picks (tuning/picks.py): a recorded key takes its pick without timing any config, a key not
recorded (or whose pick its pruning removed) autotunes as before, record() writes what install() reads, and the
shipped files name kernels and configs that exist."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from qwen_triton.tuning import picks

CONFIGS = [triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=1)]


def _tiny_tuner(prune=None):
    """An autotuned copy kernel over two configs (the interpreter runs either), its timings faked and counted."""

    @triton.jit
    def copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)

    tuner = triton.autotune(configs=list(CONFIGS), key=["n"],
                            prune_configs_by={"early_config_prune": prune} if prune else None)(copy_kernel)
    timed = []

    def fake_bench(kernel_call, quantiles):  # config BLOCK=32 is "faster"
        timed.append(tuner._current)
        return [1.0 if tuner._current == 16 else 0.5] * 3

    original = tuner._bench

    def bench(*args, config, **meta):
        tuner._current = config.kwargs["BLOCK"]
        return original(*args, config=config, **meta)

    tuner._bench = bench
    tuner.__dict__["do_bench"] = fake_bench
    return tuner, timed


def _launch(tuner, n):
    x = torch.arange(n, dtype=torch.float32)
    out = torch.zeros_like(x)
    tuner[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, out, n)
    assert torch.equal(out, x)
    return tuner.best_config.kwargs["BLOCK"]


def _pick(block: int, n: int) -> dict:
    return {"kernel": "test:copy", "key": repr((n, "torch.float32", "torch.float32")), "config": {"BLOCK": block},
            "num_warps": 1, "num_ctas": 1, "num_stages": 3, "maxnreg": None}


def test_a_recorded_key_takes_its_pick_untimed_and_others_autotune(tmp_path):
    tuner, timed = _tiny_tuner()
    path = tmp_path / "picks.json"
    picks.write(path, dict(device="test", picks=[_pick(16, 40)]))
    assert picks.install_file(path, tuners={"test:copy": tuner}) == 1
    assert _launch(tuner, 40) == 16 and timed == []  # the recorded pick (not the faster one), nothing timed
    assert _launch(tuner, 70) == 32 and timed == [16, 32]  # not recorded: both configs timed, the faster kept
    # record() writes both keys; a fresh tuner with that file times nothing for either
    assert picks.record(tmp_path / "again.json", "test", tuners={"test:copy": tuner}) == 2
    again, timed_again = _tiny_tuner()
    picks.install_file(tmp_path / "again.json", tuners={"test:copy": again})
    assert _launch(again, 40) == 16 and _launch(again, 70) == 32 and timed_again == []
    lines = (tmp_path / "again.json").read_text().splitlines()
    assert len(lines) == 4 and json.loads("".join(lines))["device"] == "test"  # one pick a line


def test_a_pick_its_pruning_removes_is_not_taken(tmp_path):
    tuner, timed = _tiny_tuner(prune=lambda configs, named_args, **kwargs: [c for c in configs if c.kwargs["BLOCK"] == 32])
    picks.write(tmp_path / "picks.json", dict(device="test", picks=[_pick(16, 40)]))
    picks.install_file(tmp_path / "picks.json", tuners={"test:copy": tuner})
    assert _launch(tuner, 40) == 32 and timed == [32]  # the pin's config, timed as before


def test_file_names_and_the_environment_switch(tmp_path, monkeypatch):
    assert picks.device_file_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3.json"
    monkeypatch.setattr(picks, "_INSTALLED", {})
    monkeypatch.setenv("QWEN_TRITON_PICKS", "off")
    assert picks.install("NVIDIA H100 80GB HBM3") is None
    monkeypatch.setattr(picks, "_INSTALLED", {})
    monkeypatch.setenv("QWEN_TRITON_PICKS", str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        picks.install("NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(picks, "_INSTALLED", {})
    monkeypatch.delenv("QWEN_TRITON_PICKS")
    assert picks.install("A GPU without picks") is None


def test_a_hopper_gpu_without_its_own_picks_takes_another_hoppers(tmp_path, monkeypatch):
    monkeypatch.setattr(picks, "PICKS_DIRECTORY", tmp_path)
    assert picks.shipped_file("NVIDIA H200") is None
    (tmp_path / "nvidia-h100-80gb-hbm3.json").write_text("{}")
    assert picks.shipped_file("NVIDIA H200").name == "nvidia-h100-80gb-hbm3.json"
    assert picks.shipped_file("NVIDIA H100 PCIe").name == "nvidia-h100-80gb-hbm3.json"
    assert picks.shipped_file("NVIDIA A100-SXM4-80GB") is None
    (tmp_path / "nvidia-h200.json").write_text("{}")
    assert picks.shipped_file("NVIDIA H200").name == "nvidia-h200.json"


SHIPPED_CHECK = """
import json, sys
from qwen_triton.operators.common import autotuners
from qwen_triton.tuning.picks import PICKS_DIRECTORY, SETTINGS, _settings
tuners = autotuners()
files = sorted(PICKS_DIRECTORY.glob("*.json"))
assert files, "no picks file shipped"
for path in files:
    document = json.loads(path.read_text())
    assert document["device"] and document["note"], path
    for pick in document["picks"]:
        tuner = tuners[pick["kernel"]]
        wanted = {name: pick[name] for name in SETTINGS}
        assert any(_settings(c) == wanted for c in tuner.configs), (path.name, pick)
        assert isinstance(eval(pick["key"]), tuple), pick["key"]
    print(path.name, len(document["picks"]))
"""


def test_the_shipped_picks_name_existing_kernels_and_configs():
    # the full config spaces: outside the interpreter (which keeps each space's first config), on the CPU
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SHIPPED_CHECK], env=env, capture_output=True, text=True,
                            cwd=Path(__file__).parents[2], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nvidia-h100-80gb-hbm3.json" in result.stdout
