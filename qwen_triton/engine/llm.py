"""The public entry point: `LLM(path, backend=..., device=..., dtype=...)` with `score` and `generate`.

A backend owns the weights and the per-sequence state (caches) and offers three calls:
`prefill(token_ids, slot)` -> float32 logits of every position, `decode(token_ids, positions)` -> float32
logits of one step for slots 0..B-1, and `reset(slot)`. The reference backend is the PyTorch model;
the triton backend composes the Triton kernels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ModelConfig, load_config
from ..progress import progress_printer
from ..weights import load_weights
from .sampling import SamplingParams, sample

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


def resolve_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but no CUDA GPU is available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device '{device}': choose 'cpu' or 'cuda'")
    return device


@dataclass
class Generation:
    """One prompt's result: the generated text and ids (the prompt excluded)."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (an end-of-turn id or a stop string) or "length" (max_new_tokens)
    timings: dict = field(default_factory=dict)


class LLM:
    def __init__(
        self,
        path: str | Path,
        backend: str = "reference",
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        max_length: int = 4096,
        max_batch: int = 8,
        progress: bool = False,
        **backend_options,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend '{backend}': choose {' or '.join(BACKENDS)}")
        self.path = Path(path)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.config: ModelConfig = load_config(self.path)
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.max_length = min(max_length, self.config.max_position_embeddings)
        self.max_batch = max_batch
        self.backend_name = backend
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
                device=self.device, dtype=self.dtype, **backend_options,
            )
        self._tokenizer = None

    # ---- text ---------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from ..tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_checkpoint(self.path)
        return self._tokenizer

    @property
    def eos_token_ids(self) -> set[int]:
        """The config's eos ids and the tokenizer's end-of-turn ids, where they are in the vocabulary."""
        ids = set(self.config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        return {i for i in ids if 0 <= i < self.config.vocab_size}

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
    ) -> Generation | list[Generation]:
        """Generate for one prompt (a string or a list of token ids) or a list of prompts.

        Each prompt stops at an end-of-turn id, at a stop string (the text is cut before it), or after
        max_new_tokens. Returns a Generation, or a list of them for a list of prompts.
        """
        single = isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and len(prompts) > 0 and all(isinstance(t, int) for t in prompts)
        )
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise ValueError("no prompts given: the prompt list is empty")
        results = [
            self._generate_one(p, max_new_tokens, SamplingParams(temperature, top_k, top_p, seed), stop)
            for p in batch
        ]
        return results[0] if single else results

    def stream(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, stop=None) -> Iterator[str]:
        """Yield the text of one prompt's generation as it is produced (whole UTF-8 characters)."""
        holder: list[Generation] = []
        yield from self._generate_iter(
            prompt, max_new_tokens, SamplingParams(temperature, top_k, top_p, seed), stop, holder
        )
        self.last_generation = holder[0]

    def _generate_one(self, prompt, max_new_tokens, params, stop) -> Generation:
        holder: list[Generation] = []
        for _ in self._generate_iter(prompt, max_new_tokens, params, stop, holder):
            pass
        return holder[0]

    def _generate_iter(self, prompt, max_new_tokens, params, stop, holder) -> Iterator[str]:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt_ids = self._encode_prompt(prompt)
        if len(prompt_ids) + max_new_tokens > self.max_length:
            max_new_tokens = self.max_length - len(prompt_ids)
            if max_new_tokens < 1:
                raise ValueError(
                    f"the prompt has {len(prompt_ids)} tokens, which leaves no room to generate within the "
                    f"maximum length {self.max_length}"
                )
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        eos = self.eos_token_ids
        decoder = self.tokenizer.stream(skip_special_tokens=True)
        generator = torch.Generator().manual_seed(params.seed)

        start = time.perf_counter()
        self.model.reset(0)
        logits = self.model.prefill(torch.tensor(prompt_ids, device=self.device), slot=0)[-1:]
        first_token_time = None
        generated: list[int] = []
        text = ""
        finish = "length"
        position = len(prompt_ids)
        while True:
            self._check_finite(logits)
            token = int(sample(logits, params, generator)[0])
            if first_token_time is None:
                first_token_time = time.perf_counter() - start
            if token in eos:
                finish = "stop"
                break
            generated.append(token)
            # ids past the tokenizer's vocabulary (the embedding's padding rows) have no text
            piece = decoder.feed(token) if token < self.tokenizer.vocab_size else ""
            hit = next((s for s in stops if s in text + piece), None)
            if hit is not None:
                full = text + piece
                piece = full[: full.index(hit)][len(text):]
                text += piece
                if piece:
                    yield piece
                finish = "stop"
                break
            text += piece
            if piece:
                yield piece
            if len(generated) >= max_new_tokens:
                break
            logits = self.model.decode(
                torch.tensor([token], device=self.device), torch.tensor([position], device=self.device)
            )
            position += 1
        if finish == "length":
            rest = decoder.flush()
            text += rest
            if rest:
                yield rest
        elapsed = time.perf_counter() - start
        decode_tokens = max(len(generated) - 1, 0)
        timings = {
            "time_to_first_token_s": first_token_time,
            "total_s": elapsed,
            "decode_tokens_per_s": decode_tokens / (elapsed - first_token_time) if decode_tokens else 0.0,
        }
        holder.append(Generation(text, generated, prompt_ids, finish, timings))
