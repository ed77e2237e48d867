"""What every kernel launcher shares: argument checks that name the tensor, and interpreter awareness.

The kernels run on an NVIDIA GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`),
which is how CI tests them. Under the interpreter, autotuning is reduced to the first config
(each config would otherwise be interpreted in turn); `QWEN_TRITON_AUTOTUNE=first` does the same on a
GPU, for correctness runs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _skip_repeated_language_patches() -> None:
    """Under the interpreter, make a device function's call skip re-patching triton.language when the running
    launch has already patched the modules it sees.

    Triton's interpreter patches triton.language's builtins for each launch (and undoes it after), and again at
    every call of a @triton.jit helper inside the kernel (never undone): four passes of inspect.getmembers over
    the language, ~0.5 ms a call, which a program with a dozen helper calls pays a dozen times, in every program
    of the grid. Inside a launch the builtins it patched are already its wrappers, so those repeated patches
    change nothing; skipping them keeps every operation as it was. A helper whose globals hold a module the
    launch did not patch (triton.language.core, for Triton's own helpers) still patches it, once a launch.
    Left as is where this Triton has no such internals."""
    import inspect

    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or scope_type is None or executor is None or getattr(patch_lang, "_skips_repeats", False):
        return
    run_grid = executor.__call__
    launch = {"active": False, "patched": None}  # patched: the language modules patched in the running launch

    seen: dict = {}  # function -> the language modules among its globals (a module's, fixed once it runs)

    def languages(fn):
        if fn not in seen:
            seen[fn] = frozenset(id(value) for value in fn.__globals__.values()
                                 if inspect.ismodule(value) and value in (tl, tl.core))
        return seen[fn]

    def patch_once(fn):
        if not launch["active"]:
            return patch_lang(fn)
        modules = languages(fn)
        if launch["patched"] is not None and modules <= launch["patched"]:
            return scope_type()  # nothing patched, nothing to undo
        scope = patch_lang(fn)
        launch["patched"] = modules | (launch["patched"] or set())
        return scope

    def run_grid_patching_once(self, *args, **kwargs):
        if launch["active"]:  # not expected: a launch inside a launch runs as Triton runs it
            return run_grid(self, *args, **kwargs)
        launch.update(active=True, patched=None)
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            launch.update(active=False, patched=None)

    patch_once._skips_repeats = True
    interpreter._patch_lang = patch_once
    executor.__call__ = run_grid_patching_once


def _skip_overflow_checks() -> None:
    """Under the interpreter, run integer arithmetic as the compiled kernels run it: without Triton's int32
    overflow checks (a GPU compile makes them only with debug=True). The interpreter makes them by default: an
    int64 copy of each operand, two compares and an assert after every integer add, sub and mul, about a third of
    an interpreted model's time. The sizes the interpreter runs never come near int32's range; the real sizes run
    compiled, on the GPU, where no check was made anyway."""
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


if interpreting():
    _skip_repeated_language_patches()
    _skip_overflow_checks()


_SM_COUNTS: dict = {}


def sm_count(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (132 on an H200); 8 off a GPU and under the interpreter, where
    it only shapes grids."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return 8
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNTS[device]


_SHARED_MEMORY: dict = {}


def shared_memory_limit(device: torch.device) -> int | None:
    """The shared memory one program may use on this GPU (bytes; 232,448 on an H100 or H200); None off a GPU and
    under the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return None
    if device not in _SHARED_MEMORY:
        _SHARED_MEMORY[device] = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return _SHARED_MEMORY[device]


def autotune_configs(configs: list) -> list:
    """The autotune search space: all configs on a GPU, the first alone under the interpreter or when
    QWEN_TRITON_AUTOTUNE=first (correctness runs on a GPU, which need no tuning); QWEN_TRITON_AUTOTUNE=N
    keeps the first N (a short tuning, for tests of the tuning machinery itself)."""
    setting = os.environ.get("QWEN_TRITON_AUTOTUNE", "")
    if interpreting() or setting == "first":
        return configs[:1]
    if setting.isdigit() and int(setting) > 0:
        return configs[:int(setting)]
    return configs


def keep_preferred(configs: list, preferred: dict | None) -> list:
    """The configs whose kwargs, num_warps, num_stages and maxnreg match every entry of `preferred` (an
    `early_config_prune` helper: where an in-graph sweep found a winner the autotuner's own timing misses);
    all of them when none matches (e.g. the interpreter's single config) or `preferred` is None."""
    if preferred is None:
        return configs

    def matches(config):
        settings = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages,
                        maxnreg=config.maxnreg)
        return all(settings.get(name) == value for name, value in preferred.items())

    return [c for c in configs if matches(c)] or configs


def preferred_entry(table, size: int, fields: tuple[str, ...]) -> dict | None:
    """A pin table's entry for `size` as config settings: table = ((largest size served, or None for any,
    (value per field)), ...), the first entry that serves `size`; None for no table (a GPU without tuning) or
    where no entry serves `size` (a table without a None entry)."""
    values = next((values for limit, values in table or () if limit is None or size <= limit), None)
    return None if values is None else dict(zip(fields, values))


def built_on_first_call(build):
    """A no-argument callable that runs build() once, on its first call, and then calls what build returned:
    a benchmark case whose inputs are allocated only when it is timed, and reused after."""
    built = {}

    def run():
        if "call" not in built:
            built["call"] = build()
        return built["call"]()

    return run


def check_tensor(
    name: str,
    tensor,
    *,
    shape: tuple | None = None,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = True,
) -> None:
    """Raise ValueError naming `name` when the tensor is not what a kernel needs.

    shape: expected sizes, None entries match anything. contiguous: fully contiguous.
    last_dim_contiguous: unit stride in the last dim (rows may be strided views of a fused buffer).
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if shape is not None:
        if tensor.dim() != len(shape) or any(e is not None and e != s for e, s in zip(shape, tensor.shape)):
            expected = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
            raise ValueError(f"{name} has shape {list(tensor.shape)}, expected {expected}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if tensor.dtype not in allowed:
            raise ValueError(f"{name} has dtype {tensor.dtype}, expected {' or '.join(map(str, allowed))}")
    if device is not None and tensor.device != torch.device(device):
        raise ValueError(f"{name} is on {tensor.device}, expected {device}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {tensor.stride()})")
    if last_dim_contiguous and tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension (strides {tensor.stride()})")


def check_same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must share one device: {listing}")


# ---- programmatic dependent launch (PDL) -------------------------------------------------------------
# On Hopper a kernel launched with the programmatic-stream-serialization attribute (Triton's
# `launch_pdl=True`) may start while the kernel before it in the stream is still running, as soon as every
# program of that kernel has executed `griddepcontrol.launch_dependents`. It must then execute
# `griddepcontrol.wait` before it touches anything an earlier kernel writes; the wait returns once the
# previous kernel has completed and its writes are visible. Loads of data no kernel writes (the weights)
# may go before the wait: they stream while the previous kernel drains. Because every kernel launched
# with PDL waits before its own writes, the ordering is transitive down the stream, and a kernel launched
# without the attribute simply waits for everything before it, as usual.


def hopper_or_later(device) -> bool:
    """Whether `device` is a GPU of compute capability 9.0 or more (PDL, TMA)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_available(device) -> bool:
    """Whether kernels on `device` can use programmatic dependent launch (compute capability >= 9.0; not
    under the interpreter)."""
    return not interpreting() and hopper_or_later(device)


def launch_options(pdl: bool) -> dict:
    """The extra launch keywords of a kernel that supports PDL (its USE_PDL constexpr set alike)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def allow_next_kernel(USE_PDL: tl.constexpr):
    """Let the next kernel in the stream launch now (it waits for this one before reading its output)."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed and its writes are visible."""
    if USE_PDL:
        gdc_wait()


# ---- decode rows and sequence slots ----------------------------------------------------------------
# A decode kernel's row r works on the sequence in slot slots[r] (int32 [B] on the device, distinct, below the
# state's slot count; read by the kernel, so a CUDA graph replays with whatever slots were written into the
# buffer). A negative slot marks a padding row of a batch bucket: the kernels read and write no state for it
# (its outputs are left as they are, or zeros). Without slots (a direct caller), row r is slot r.


@triton.jit
def sequence_slot(slots, row, HAS_SLOTS: tl.constexpr):
    """The slot of decode row `row`: slots[row] (negative: a padding row), or `row` itself without slots."""
    if HAS_SLOTS:
        slot = tl.load(slots + row)
    else:
        slot = row
    return slot


def check_slots(slots, rows: int, fallback: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the pointer argument, HAS_SLOTS) of a decode kernel's `slots`: slots int32 [rows] (contiguous), or None
    for rows 0..rows-1, when fallback (any tensor of the call) stands in as the unused pointer. The slots'
    values are device data: not checked."""
    if slots is None:
        return fallback, False
    check_tensor("slots", slots, shape=(rows,), dtype=torch.int32, contiguous=True)
    return slots, True


def autotuners() -> dict:
    """{"module:name": Autotuner} of every autotuned kernel of the package (a tuner under its first name)."""
    import importlib
    import pkgutil

    from triton.runtime.autotuner import Autotuner

    from .. import operators

    found, seen = {}, set()
    for info in pkgutil.walk_packages(operators.__path__, operators.__name__ + "."):
        module = importlib.import_module(info.name)
        for name, value in sorted(vars(module).items()):
            if isinstance(value, Autotuner) and id(value) not in seen:
                seen.add(id(value))
                found[f"{info.name.removeprefix(operators.__name__ + '.')}:{name}"] = value
    return found


def autotune_choices() -> list[dict]:
    """The config each autotuned kernel of the package uses for each key it has met in this process (tuned
    here, or read from the autotune cache on disk): [{kernel, key, config, num_warps, num_stages, maxnreg}], so a
    profile can say which tiles ran. Empty under the interpreter, which tunes nothing."""
    return [dict(kernel=kernel, key=[str(part) for part in key], config=dict(config.kwargs),
                 num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.maxnreg)
            for kernel, tuner in autotuners().items() for key, config in tuner.cache.items()]
