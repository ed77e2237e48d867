"""The warm-up (engine/warmup.py): after `LLM(...)` returns, no request compiles or autotunes, and the warm-up leaves
nothing behind that a generation could see.

On the CPU the interpreter compiles and tunes nothing, so the check is made at the level Triton decides at: every
launch's compile identity (the kernel, its constexprs and launch options, and Triton's specialisation of each
other argument: an integer 1, a multiple of 16 or neither, a pointer 16-byte aligned or not) and every autotuner
key (its key arguments and its tensors' dtypes, as Autotuner.run forms it). A request may only meet identities and
keys the warm-up met. The kernels need not run for that (no launch's arguments depend on another's results), so
that test launches nothing (`LaunchRecorder(dry=True)`) and can afford the prompt lengths of every threshold of the
plan, bf16 (the TMA loads) and a max_length past 4096. On a GPU the same is checked with Triton's own hooks: no
compilation, no benchmarking after the warm-up."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import pkgutil
import random
import time

import pytest
import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.autotuner import Autotuner

from qwen_triton import LLM, operators
from qwen_triton.engine import warmup
from qwen_triton.engine.sampling import SamplingParams
from qwen_triton.engine.triton_model import TritonModel
from qwen_triton.tokenizer import Tokenizer
from tests.support import small_config, write_checkpoint

SAMPLINGS = (  # greedy, and each kind of sampled batch (device_sampling.py's modes)
    SamplingParams(),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=2),
    SamplingParams(temperature=0.7, min_p=0.05, seed=3),
    SamplingParams(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5, seed=4),
    SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3),
)


def _tuner_names() -> dict[int, str]:
    """id(autotuner) -> "module:name" for every autotuned kernel of the package (gemm.py has four over one kernel)."""
    names = {}
    for info in pkgutil.walk_packages(operators.__path__, operators.__name__ + "."):
        for name, value in vars(importlib.import_module(info.name)).items():
            if isinstance(value, Autotuner):
                names.setdefault(id(value), f"{info.name.removeprefix('qwen_triton.operators.')}:{name}")
    return names


class LaunchRecorder:
    """Every launch's compile identity and every autotuner key, from the moment `install` patches Triton's
    interpreter; with dry=True the kernels do not run (and the host takes the first id of a prompt as 0 and its
    logits as finite: what it reads of them; the decode steps' ids it reads stay the zeros they start as)."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.identities: list[tuple] = []
        self.keys: list[tuple] = []
        self.tuners = _tuner_names()

    def install(self, monkeypatch) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        recorder, run_kernel, run_tuner = self, InterpretedFunction.run, Autotuner.run

        def launch(function, *args, grid, warmup, **kwargs):
            recorder.identities.append(recorder.identity(function, args, kwargs))
            if not recorder.dry:
                return run_kernel(function, *args, grid=grid, warmup=warmup, **kwargs)
            return None

        def tune(tuner, *args, **kwargs):
            recorder.keys.append(recorder.key(tuner, args, kwargs))
            return run_tuner(tuner, *args, **kwargs)

        monkeypatch.setattr(InterpretedFunction, "run", launch)
        monkeypatch.setattr(Autotuner, "run", tune)
        if self.dry:  # what the host reads of the kernels' results: the prefill's logits and the first id
            choose = TritonModel.choose_first_rows
            monkeypatch.setattr(LLM, "_check_finite", lambda llm, logits: None)
            monkeypatch.setattr(TritonModel, "choose_first_rows", lambda model, *args, **kwargs:
                                choose(model, *args, **kwargs).zero_())

    @staticmethod
    def identity(function, args, kwargs) -> tuple:
        """What Triton compiles a launch for: the kernel, its constexprs and options, each argument's
        specialisation (triton/runtime/jit.py's, from the same native function)."""
        parameters = list(inspect.signature(function.fn).parameters.values())
        names = [p.name for p in parameters]
        values = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
        unspecialized = set(function.kwargs.get("do_not_specialize") or ())
        parts = []
        for index, parameter in enumerate(parameters):
            value = values.get(parameter.name, parameter.default)
            if "constexpr" in str(parameter.annotation):
                parts.append((parameter.name, repr(value)))
                continue
            specialize = parameter.name not in unspecialized and index not in unspecialized
            parts.append((parameter.name, native_specialize_impl(BaseBackend, value, False, specialize, True)))
        options = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in names))
        return (f"{function.fn.__module__}:{function.fn.__qualname__}", tuple(parts), options)

    def key(self, tuner, args, kwargs) -> tuple:
        """Autotuner.run's tuning key: the key arguments' values, then every tensor argument's dtype."""
        given = {k: v for k, v in dict(zip(tuner.arg_names, args), **kwargs).items() if k in tuner.arg_names}
        key = [given[name] for name in tuner.keys if name in given]
        key += [str(value.dtype) for value in given.values() if hasattr(value, "dtype")]
        return (self.tuners.get(id(tuner), repr(tuner.fn)), tuple(key))

    def since(self, mark: tuple[int, int]) -> tuple[set, set]:
        return set(self.identities[mark[0]:]), set(self.keys[mark[1]:])

    def mark(self) -> tuple[int, int]:
        return len(self.identities), len(self.keys)


def _names(entries) -> str:
    return "\n".join(sorted({str(entry)[:400] for entry in entries}))


# ---- no request meets a kernel, key or specialisation the warm-up did not ----------------------------------------
MAX_LENGTH = 4200  # past 4096: buckets 8192 of the GEMMs, the attention and the chunked rule
MAX_BATCH = 3  # not a power of two: its own bucket of 3 (buffers.bucket)
THRESHOLD_LENGTHS = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 255, 256, 257, 272, 496, 511, 512, 513, 1000,
                     1023, 1024, 1025, 1040, 2047, 2048, 2049, 2064, 3000, 4095, 4096, 4097, 4112, 4199)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_no_request_meets_a_kernel_key_or_specialisation_the_warm_up_did_not(tmp_path, monkeypatch, dtype):
    recorder = LaunchRecorder(dry=True)
    recorder.install(monkeypatch)
    directory = write_checkpoint(tmp_path, small_config(), seed=3)
    llm = LLM(directory, backend="triton", device="cpu", dtype=dtype, max_length=MAX_LENGTH, max_batch=MAX_BATCH,
              warm_up=True, tokenizer=Tokenizer.default())
    report = llm.warm_up_report
    assert report.batches == (1, 2, 3) and report.first_token_rows == (0, 1, 2) and report.prefill_slots == (0,)
    row_bytes = llm.config.hidden_size * dtype.itemsize
    assert tuple(warmup.prefill_lengths(llm.model.plan, MAX_LENGTH, row_bytes)) == report.prefill_lengths
    warmed_identities, warmed_keys = recorder.since((0, 0))
    assert any("gemm" in name for name, _ in warmed_keys) and any("prefill" in name for name, _ in warmed_keys)
    mark = recorder.mark()

    draw = random.Random(0)
    lengths = list(THRESHOLD_LENGTHS) + draw.sample(range(1, MAX_LENGTH), 25)
    draw.shuffle(lengths)
    for index, length in enumerate(lengths):  # one prompt at a time and batches of 2 and 3, every kind of sampling
        rows = 1 + index % MAX_BATCH
        prompts = [[draw.randrange(300) for _ in range(length if row == 0 else draw.randrange(1, 40))]
                   for row in range(rows)]
        llm.generate(prompts, max_new_tokens=3, sampling_params=[SAMPLINGS[(index + row) % len(SAMPLINGS)]
                                                                  for row in range(rows)])
    llm.score([draw.randrange(300) for _ in range(6)], prefill=1)  # score's decode steps (mode "logits")
    identities, keys = recorder.since(mark)
    print(f"\n{report.summary()}; requests: {len(identities)} compile identities, {len(keys)} autotuner keys; the "
          f"warm-up {len(warmed_identities)} and {len(warmed_keys)}")
    assert keys, "nothing recorded: the recorder is not in the launches' path"
    assert not keys - warmed_keys, "autotuner keys first met in a request:\n" + _names(keys - warmed_keys)
    assert not identities - warmed_identities, ("kernels first compiled in a request:\n"
                                                + _names(identities - warmed_identities))


def test_prefill_lengths_cover_every_signature_once():
    """At the 0.8B shape on the H200: one length per signature, each the longest of its signature, the bucket tops
    first (every threshold of the H200's table starts a bucket: 17, 257, 1025, 2049)."""
    from qwen_triton.checkpoint import PRESETS, official_config
    from qwen_triton.config import parse_config
    from qwen_triton.engine.plan import DEVICES, resolve_plan

    plan = resolve_plan(parse_config(official_config(PRESETS["0.8b"])), DEVICES["h200"])
    lengths = warmup.prefill_lengths(plan, 5000, 2048)
    signatures = [warmup.prefill_signature(plan, tokens, 2048) for tokens in lengths]
    assert len(set(signatures)) == len(lengths)
    assert set(signatures) == {warmup.prefill_signature(plan, tokens, 2048) for tokens in range(1, 5001)}
    buckets = [triton.next_power_of_2(tokens) for tokens in lengths]
    assert buckets == sorted(buckets) and buckets[-1] == 8192
    assert [tokens for tokens in lengths if tokens == min(triton.next_power_of_2(tokens), 5000)] == [
        1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 5000]
    assert lengths[lengths.index(512):lengths.index(1024)] == [512, 511, 480, 479]  # T and its 16 chunks of 32
    assert len(lengths) < 60, lengths  # a few per bucket


def test_the_warm_up_is_on_by_default_on_a_gpu_only(monkeypatch):
    from qwen_triton.engine.llm import default_warm_up
    from qwen_triton.operators.common import interpreting

    monkeypatch.delenv("QWEN_TRITON_WARM_UP", raising=False)  # (the tests' conftest sets it to 0)
    assert default_warm_up("cpu") is False
    assert default_warm_up("cuda") == (not interpreting())  # (a GPU under the interpreter tunes nothing either)
    for value, chosen in (("1", True), ("0", False)):
        monkeypatch.setenv("QWEN_TRITON_WARM_UP", value)
        assert default_warm_up("cpu") is chosen and default_warm_up("cuda") is chosen
    monkeypatch.setenv("QWEN_TRITON_WARM_UP", "yes")
    with pytest.raises(ValueError, match="QWEN_TRITON_WARM_UP must be 0 or 1"):
        default_warm_up("cuda")


# ---- no state left behind; progress -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The same checkpoint loaded with and without the warm-up (its stderr kept), kernels run (interpreted): two
    layers, 4 tokens, 2 sequences, so that the warm-up's 3 prefills and 14 decode steps take seconds."""
    config = small_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    directory = write_checkpoint(tmp_path_factory.mktemp("model"), config, seed=5)
    options = dict(backend="triton", device="cpu", dtype=torch.float32, max_length=4, max_batch=2,
                   tokenizer=Tokenizer.default())
    printed = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stderr(printed):
        warmed = LLM(directory, warm_up=True, progress=True, **options)
    load_seconds = time.perf_counter() - started
    return warmed, LLM(directory, **options), printed.getvalue(), load_seconds


@pytest.mark.slow
def test_generation_after_the_warm_up_equals_generation_without(models):
    """A batch of two in slots 0 and 1 (which the warm-up's prefills and decode steps used), a greedy row and a
    sampled one with penalties (the mode whose step keeps the most state: the rows' token counts)."""
    warmed, plain, _, _ = models
    assert plain.warm_up_report is None  # the CPU's default
    states = list(warmed.model.state.conv.values()) + list(warmed.model.state.recurrent.values())
    assert all(bool((t == 0).all()) for t in states)
    assert not warmed.model._buffers  # the warm-up's decode buffers were its own
    rows = [SamplingParams(presence_penalty=0.5), SamplingParams(temperature=0.9, top_k=5, repetition_penalty=1.2,
                                                                   seed=7)]
    results = [llm.generate([[5, 17], [9]], max_new_tokens=2, sampling_params=rows) for llm in (warmed, plain)]
    assert [r.token_ids for r in results[0]] == [r.token_ids for r in results[1]]
    assert all(len(r.token_ids) == 2 for r in results[0])


@pytest.mark.slow
def test_the_warm_up_shows_its_progress_and_time(models):
    warmed, _, printed, load_seconds = models
    report = warmed.warm_up_report
    assert report.prefill_lengths == (1, 2, 4) and report.batches == (1, 2) and len(report.modes) == len(warmup.DECODE_MODES) == 9
    assert "warm-up: prefill buckets: 3/3" in printed and "warm-up: decode batches: 2/2" in printed
    assert printed.strip().splitlines()[-1] == report.summary()
    assert report.packed_tokens == (64,) and report.packed_rows == (1,)  # max_length 4: one bucket, one prompt a pass
    assert "warm-up: packed prefill buckets: 1/1" in printed
    assert report.summary().startswith("warm-up: 3 prefill lengths (3 buckets, 1 to 4 tokens), 1 packed prefill "
                                       "buckets (64 to 64 tokens), decode at batch 1, 2 in 9 modes: ")
    assert 0 < report.seconds <= load_seconds
    assert "first prefill" not in printed  # the model's first-run lines: the warm-up's say it instead
    print(f"\n{report.summary()} (LLM() {load_seconds:.1f} s)")


# ---- GPU: no compilation, no benchmarking after the warm-up --------------------------------------------------------
@pytest.mark.gpu
def test_gpu_random_prompt_lengths_neither_compile_nor_tune_after_the_warm_up(monkeypatch):
    from qwen_triton.benchmark.models import random_llm

    started = time.perf_counter()
    llm = random_llm("0.8b", max_length=4096, max_batch=4, warm_up=True)
    print(f"\n{llm.warm_up_report.summary()}; LLM() {time.perf_counter() - started:.1f} s")
    compiled, benchmarked = [], []

    def on_compile(**details):
        compiled.append(details["repr"])
        return False  # compile as usual

    bench = Autotuner._bench
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", on_compile)
    monkeypatch.setattr(Autotuner, "_bench", lambda tuner, *args, **kwargs: benchmarked.append(tuner.fn)
                        or bench(tuner, *args, **kwargs))
    draw = random.Random(1)
    lengths = draw.sample([n for n in range(16, 4000) if n != 1531], 12) + [1, 17, 257, 1025, 2049, 4000]
    for index, length in enumerate(lengths):
        rows = 1 + index % 4
        prompts = [[draw.randrange(248_000) for _ in range(length if row == 0 else 8 + row)] for row in range(rows)]
        llm.generate(prompts, max_new_tokens=4,
                     sampling_params=[SAMPLINGS[(index + row) % len(SAMPLINGS)] for row in range(rows)])
    # a length never seen, three times: each replays its packed bucket's graphs (graphs.PackedPrefillGraphs)
    times = [llm.generate([draw.randrange(248_000) for _ in range(1531)], max_new_tokens=1)
             .timings["time_to_first_token_s"] * 1e3 for _ in range(3)]
    print("time to first token at 1,531 tokens, three times: " + " / ".join(f"{ms:.2f}" for ms in times) + " ms")
    assert not benchmarked, f"autotuning in a request: {benchmarked[:5]}"
    assert not compiled, "compiled in a request:\n" + "\n".join(compiled[:10])
