"""The OpenAI wire format: the requests (pydantic models that check every parameter's type and range), the
responses and stream chunks, and the error body.

Requests are parsed strictly (a number where a number belongs, no string "5"), and names the server does not
know are ignored, as OpenAI-compatible servers do; the OpenAI parameters the server knows but cannot honour
(`echo`, `suffix`, `best_of` > `n`, a `logit_bias`, `tools`, a `response_format` other than text) are refused
with a 400 rather than silently ignored. Sampling defaults are OpenAI's: temperature 1, top_p 1, no seed (a
random one per request).
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..engine.sampling import SamplingParams

MAX_LOGPROBS = 20
MAX_CHOICES = 128
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # torch.Generator.manual_seed's


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def validation_error(error: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the parameter."""
    first = error.errors(include_url=False)[0]
    location = first["loc"]
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "json_invalid":
        return invalid(f"the body is not valid JSON: {message.removeprefix('Invalid JSON: ')}", code="invalid_json")
    if not location:
        return invalid(f"the body must be a JSON object: {message}", code="invalid_body")
    path = str(location[0]) + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in location[1:])
    if first["type"] == "missing":
        return invalid(f"{path} is required", param=str(location[0]), code="missing_parameter")
    if first["type"] == "value_error":  # the protocol's own checks, whose messages name the parameter
        return invalid(message, param=str(location[0]), code="invalid_value")
    value = first.get("input")
    shown = "" if isinstance(value, (dict, list)) or value is None else f" (got {value!r})"
    return invalid(f"{path}: {message}{shown}", param=str(location[0]), code="invalid_value")


# ---- requests -------------------------------------------------------------------------------------
class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far (a load generator's count of the ids each chunk holds)
    continuous_usage_stats: bool = False


class SamplingRequest(StrictModel):
    """The parameters completions and chat completions share."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM's -1 and this engine's 0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Any = Field(default_factory=list)  # a string or a list of strings (checked below): a list
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value):
        if value is None:
            return []
        strings = [value] if isinstance(value, str) else value
        if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
            raise ValueError("stop must be a string or a list of strings")
        if any(not s for s in strings):
            raise ValueError("stop: a stop string must not be empty")
        return strings

    def check_common(self) -> None:
        """What a field's own type and range cannot say."""
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream=true", param="stream_options")

    def sampling_params(self, choice: int, seed: int) -> SamplingParams:
        """The choice's SamplingParams: each choice of a request draws with its own seed (seed + choice)."""
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=max(self.top_k or 0, 0),
                top_p=1.0 if self.top_p is None else self.top_p,
                seed=(seed + choice) % 2 ** 64,
                min_p=self.min_p or 0.0,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            )
        except ValueError as error:
            raise invalid(str(error)) from None

    def request_seed(self) -> int:
        return secrets.randbits(63) if self.seed is None else self.seed

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. prompt: a string, a list of token ids, or a list of either (one completion each)."""

    prompt: Any  # required
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    logit_bias: dict[str, float] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value):
        """A list of prompts, each a string or a list of token ids."""
        shape = "prompt must be a string, a list of token ids, or a list of strings or of lists of token ids"
        if isinstance(value, str):
            prompts = [value]
        elif isinstance(value, list) and value and all(_is_id(t) for t in value):
            prompts = [value]
        elif isinstance(value, list) and value:
            prompts = value
            for item in prompts:
                if not (isinstance(item, str) or (isinstance(item, list) and all(_is_id(t) for t in item))):
                    raise ValueError(shape)
        elif isinstance(value, list):
            raise ValueError("prompt is empty: give at least one prompt")
        else:
            raise ValueError(shape)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("prompt is empty: a prompt needs at least one token")
        return prompts

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise invalid("echo is not supported by this server", param="echo", code="unsupported_parameter")
        if self.suffix is not None:
            raise invalid("suffix is not supported by this server", param="suffix", code="unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of is not supported by this server (leave it out, or equal to n)",
                          param="best_of", code="unsupported_parameter")
        if self.logit_bias:
            raise invalid("logit_bias is not supported by this server", param="logit_bias",
                          code="unsupported_parameter")


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class TextPart(StrictModel):
    type: str
    text: str | None = None


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_message(self) -> dict:
        """The message as the chat template reads it: content as text (a developer message is a system one)."""
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"a content part of type {part.type!r}: only text parts are supported")
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: messages through the checkpoint's chat template."""

    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise invalid("messages is empty: a conversation needs at least one message", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.tools:
            raise invalid("tools are not supported by this server", param="tools", code="unsupported_parameter")
        if self.tool_choice not in (None, "none", "auto"):
            raise invalid("tool_choice is not supported by this server", param="tool_choice",
                          code="unsupported_parameter")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise invalid("response_format: only {\"type\": \"text\"} is supported by this server",
                          param="response_format", code="unsupported_parameter")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses ------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed one (the same shape, as OpenAI sends it)."""

    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None
    refusal: list[ChatLogprob] | None = None


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "qwen-triton"
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
