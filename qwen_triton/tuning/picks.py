"""Recorded autotuner picks: the config each autotuned kernel chose for each key, per GPU, so that a first start
on a machine with an empty Triton cache compiles one config per key instead of timing the whole space.

The tables in this package pin what in-graph sweeps measured (a few keys per kernel); the rest of the keys a
warm-up reaches (every length bucket up to max_length, every batch bucket, every sampling mode) autotune: on an
H100 with an empty Triton cache, 173 keys took 168 s of a 199 s warm-up for 128 sequences of up to 2,304 tokens
(docs/decisions.md, D143). `qwen-triton tune` runs that warm-up once with full autotuning and writes what the
autotuner chose (`record`); a file of picks for this GPU (picks/<gpu>.json, the GPU's name in lower case with
dashes; for a Hopper GPU without its own, another Hopper GPU's; or QWEN_TRITON_PICKS=FILE) makes each recorded key
take its pick without timing (`install`).

A pick applies only where it is still a candidate: among the kernel's configs after its own pruning (the tables'
pins, the shape's limits). A key not in the file, or whose pick is no longer a candidate, autotunes as before.
QWEN_TRITON_PICKS=off turns the files off (what `qwen-triton tune` does while it records).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..operators.common import autotuners

PICKS_DIRECTORY = Path(__file__).parent / "picks"
_INSTALLED: dict = {}  # "file": the file installed in this process (None: none found)


def device_file_name(device_name: str) -> str:
    """picks/<this>: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3.json"."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") + ".json"


SETTINGS = ("config", "num_warps", "num_stages", "num_ctas", "maxnreg")  # a pick's fields beside kernel and key


def _settings(config) -> dict:
    return dict(config=dict(config.kwargs), num_warps=config.num_warps, num_stages=config.num_stages,
                num_ctas=config.num_ctas, maxnreg=config.maxnreg)


def _key(tuner, kwargs: dict) -> tuple:
    """The autotuner's key for the launch being tuned, computed as Autotuner.run computes it (triton 3.6): the key
    arguments' values, then the dtype of every argument that has one."""
    arguments = {name: value for name, value in {**tuner.nargs, **kwargs}.items() if name in tuner.arg_names}
    key = [arguments[name] for name in tuner.keys if name in arguments]
    key += [str(value.dtype) for value in arguments.values() if hasattr(value, "dtype")]
    return tuple(key)


def record(path: str | Path, device_name: str, note: str = "", tuners: dict | None = None) -> int:
    """Write every key each autotuner has chosen a config for in this process to `path` (JSON); returns the count."""
    import triton

    tuners = autotuners() if tuners is None else tuners
    picks = [dict(kernel=kernel, key=repr(key), **_settings(config))
             for kernel, tuner in sorted(tuners.items()) for key, config in tuner.cache.items()]
    write(path, dict(device=device_name, triton=triton.__version__, note=note, picks=picks))
    return len(picks)


def write(path: str | Path, document: dict) -> None:
    """The picks file: its header, then one pick a line (a diff shows the picks that changed)."""
    header = {name: value for name, value in document.items() if name != "picks"}
    lines = [json.dumps(pick) for pick in document["picks"]]
    text = json.dumps(header)[:-1] + ', "picks": [\n' + ",\n".join(lines) + "\n]}\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def install_file(path: str | Path, tuners: dict | None = None) -> int:
    """Make each autotuner take the recorded pick of a key it meets (where the pick is among its candidates)
    without timing; returns the number of picks that name a kernel of this package."""
    document = json.loads(Path(path).read_text())
    tuners = autotuners() if tuners is None else tuners
    by_kernel: dict = {}
    for pick in document["picks"]:
        if pick["kernel"] in tuners:
            by_kernel.setdefault(pick["kernel"], {})[pick["key"]] = {name: pick[name] for name in SETTINGS}
    for kernel, picks in by_kernel.items():
        _hook(tuners[kernel], picks)
    return sum(len(picks) for picks in by_kernel.values())


def _hook(tuner, picks: dict) -> None:
    """Wrap the tuner's pruning (a recorded pick among the candidates becomes the only one) and its timing (the
    recorded pick is not timed). Replaces an earlier hook's picks."""
    if getattr(tuner, "_recorded_picks", None) is not None:
        tuner._recorded_picks = picks
        return
    tuner._recorded_picks = picks
    tuner._taking_pick = None
    prune, bench = tuner.prune_configs, tuner._bench

    def prune_to_pick(kwargs):
        candidates = prune(kwargs)
        wanted = tuner._recorded_picks.get(repr(_key(tuner, kwargs)))
        if wanted is not None:
            for config in candidates:
                if _settings(config) == wanted:
                    tuner._taking_pick = config
                    return [config]
        return candidates

    def bench_unless_pick(*args, config, **meta):
        if config is tuner._taking_pick:
            tuner._taking_pick = None
            return [0.0, 0.0, 0.0]
        return bench(*args, config=config, **meta)

    tuner.prune_configs = prune_to_pick
    tuner._bench = bench_unless_pick


def shipped_file(device_name: str) -> Path | None:
    """The shipped picks of this GPU: picks/<gpu>.json, else, for a Hopper GPU, those of another Hopper GPU (the
    same SMs and shared memory; they share the tuning table too, D144): the H200 takes the H100's (D157)."""
    from . import HOPPER_NAMES

    own = PICKS_DIRECTORY / device_file_name(device_name)
    if own.is_file():
        return own
    if any(part in device_name.upper() for part in HOPPER_NAMES):
        for other in HOPPER_NAMES:
            found = sorted(PICKS_DIRECTORY.glob(f"*{other.lower()}*.json"))
            if found:
                return found[0]
    return None


def install(device_name: str) -> Path | None:
    """Once per process: the picks of this GPU (QWEN_TRITON_PICKS=FILE, or `shipped_file`; off: none)."""
    if "file" in _INSTALLED:
        return _INSTALLED["file"]
    setting = os.environ.get("QWEN_TRITON_PICKS", "")
    path = None if setting == "off" else Path(setting) if setting else shipped_file(device_name)
    if path is not None and setting and not path.is_file():
        raise FileNotFoundError(f"QWEN_TRITON_PICKS={setting}: no such file")
    if path is not None:
        install_file(path)
    _INSTALLED["file"] = path
    return path
