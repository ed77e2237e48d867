"""The HTTP side of the server: `create_app(llm)`, a FastAPI app that serves the OpenAI API from an LLM.

Routes: GET /v1/models (and /v1/models/{id}), POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics. A request is parsed and checked (protocol.py), its prompts tokenized (a chat's messages through
the checkpoint's chat template first), and one Sequence per prompt and choice handed to the scheduler's engine
thread (scheduler.py). The engine thread posts each step's outputs to the event loop in one call; there each
choice's ids become text (detokenizer.py, which also finds the stop strings and then aborts the sequence), and
leave as server-sent events or gathered into one response. So tokenizing, detokenizing and SSE framing run on
the event loop's thread, never on the engine's.

Errors leave in OpenAI's format with their status (protocol.APIError): 400 for a bad request, 404 for an
unknown model or route, 429 when the queue is full, 503 while stopping; 500 only for a failure of the server
itself. A client that goes away has its sequences aborted at once (their slots are free by the next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import secrets
import time

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from . import heap
from .detokenizer import IncrementalDetokenizer
from .metrics import ServerMetrics
from .protocol import (APIError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                       ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatLogprob, ChatLogprobs,
                       CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, ModelCard,
                       ModelList, TopLogprob, Usage, invalid, validation_error)
from .scheduler import STOPPING, QueueFull, Scheduler, ShuttingDown
from .sequence import Sequence, SequenceOutput

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; a chat's is the room left
DISCONNECTED = object()  # put on a request's queue when its client goes away
logger = logging.getLogger("qwen_triton.server")


class ClientDisconnected(Exception):
    """The client of a request in flight went away."""


class EngineError(APIError):
    """An error output of a sequence in flight (a failed step, or the server stopping): its request's Job
    counts it in the metrics, so the error handler does not."""


# ---- one request's choices ------------------------------------------------------------------------
class Choice:
    """One choice of a response, assembled as its sequence's outputs arrive: its text (released by the
    detokenizer), its count of generated ids, its log-probabilities and why it ended."""

    def __init__(self, sequence: Sequence, tokenizer, stop: list[str]):
        self.sequence = sequence
        self.detokenizer = IncrementalDetokenizer(tokenizer, stop)
        self.tokens = 0
        self.finish_reason: str | None = None
        # (id, log-probability, the likeliest [(id, log-probability)], the id's offset in the text)
        self.logprobs: list[tuple[int, float, list[tuple[int, float]], int]] = []

    @property
    def index(self) -> int:
        return self.sequence.index

    @property
    def text(self) -> str:
        return self.detokenizer.text

    def take(self, output: SequenceOutput) -> tuple[str, list]:
        """Apply one output: the text it releases and the log-probability entries it adds."""
        offset = self.detokenizer.offset
        # a stop id (an end-of-turn id or one of stop_token_ids) ends the choice without its text
        piece = self.detokenizer.feed(output.token_id) if output.finish_reason != "stop" else ""
        self.tokens += 1
        entries = []
        if output.logprob is not None:
            entries = [(output.token_id, output.logprob, output.top_logprobs or [], offset)]
            self.logprobs += entries
        if self.detokenizer.stopped:
            self.finish_reason = "stop"
        elif output.finish_reason is not None:
            piece += self.detokenizer.finish()
            self.finish_reason = output.finish_reason
        return piece, entries


class Job:
    """A request's sequences in flight: the queue their outputs arrive on and their choices. `updates()`
    yields (choice, text piece, log-probability entries) until every choice has ended; `close()` aborts what
    has not, and records the request's outcome and tokens in the metrics."""

    def __init__(self, service: OpenAIService, sequences: list[Sequence], stop: list[str], prompt_tokens: int):
        self.service = service
        self.receiver: asyncio.Queue = asyncio.Queue()
        for sequence in sequences:
            sequence.receiver = self.receiver
        self.sequences = sequences
        self.choices = {s.index: Choice(s, service.tokenizer, stop) for s in sequences}
        self.prompt_tokens = prompt_tokens
        self.unfinished = len(sequences)
        self.outcome = "aborted"  # until every choice ends (or an error says otherwise)
        self.closed = False

    def usage(self) -> Usage:
        completion = sum(choice.tokens for choice in self.choices.values())
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                     total_tokens=self.prompt_tokens + completion)

    async def updates(self):
        """(choice, text, entries) as outputs arrive. The outputs already waiting when one arrives are taken with
        it, each choice's merged into one update: an HTTP side that lags the engine sends fewer, longer chunks
        (the same text and ids) instead of falling further behind (docs/decisions.md, D145)."""
        while self.unfinished:
            items = [await self.receiver.get()]
            while not self.receiver.empty():
                items.append(self.receiver.get_nowait())
            merged: dict[int, list] = {}  # a choice's index -> [choice, text, entries], in order of arrival
            failure = None
            for item in items:
                if item is DISCONNECTED:
                    failure = ClientDisconnected()
                    break
                sequence, output = item
                choice = self.choices[sequence.index]
                if choice.finish_reason is not None:
                    continue  # ids the engine chose before it learnt of a stop string
                if output.error is not None:
                    stopping = output.error == STOPPING
                    self.outcome = "rejected" if stopping else "failed"
                    failure = EngineError(503 if stopping else 500, output.error,
                                          code="shutting_down" if stopping else "engine_error")
                    break
                piece, entries = choice.take(output)
                if choice.finish_reason is not None:
                    self.unfinished -= 1
                    if output.finish_reason is None:  # a stop string: the engine does not know it ended
                        self.service.scheduler.abort([sequence])
                update = merged.setdefault(sequence.index, [choice, "", []])
                update[1] += piece
                update[2] += entries
            for choice, piece, entries in merged.values():
                yield choice, piece, entries
            if failure is not None:
                raise failure
        self.outcome = "success"

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        running = [c.sequence for c in self.choices.values() if c.finish_reason is None]
        if running:
            self.service.scheduler.abort(running)
        metrics = self.service.metrics
        metrics.requests.inc(outcome=self.outcome)
        usage = self.usage()
        metrics.prompt_tokens.inc(usage.prompt_tokens)
        metrics.generation_tokens.inc(usage.completion_tokens)


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class EventStream(StreamingResponse):
    """A response of server-sent events over a job: when the response ends, however it ends (done, the client
    gone, the server cancelling it at shutdown), the job is closed, which aborts what is still running."""

    def __init__(self, events, job: Job):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()


# ---- the routes' work -----------------------------------------------------------------------------
class OpenAIService:
    """What the routes do, over one LLM (its tokenizer, chat template and end-of-turn ids) and the scheduler
    running its backend."""

    def __init__(self, llm, scheduler: Scheduler, model_name: str, metrics: ServerMetrics):
        self.llm, self.scheduler, self.model_name, self.metrics = llm, scheduler, model_name, metrics
        self.tokenizer = llm.tokenizer
        self.eos_token_ids = frozenset(llm.eos_token_ids)
        self.max_length = scheduler.max_length
        self.created = int(time.time())

    # ---- models ---------------------------------------------------------------------------------
    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_length)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist: this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    # ---- requests -------------------------------------------------------------------------------
    @staticmethod
    async def parse(request: Request, model: type):
        content_type = request.headers.get("content-type", "")
        media_type = content_type.split(";")[0].strip().lower()
        if media_type and media_type != "application/json":
            raise invalid(f"the body must be JSON, sent with Content-Type: application/json (got {content_type!r})",
                          code="invalid_content_type")
        body = await request.body()
        if not body.strip():
            raise invalid("the body is empty: send the request as a JSON object", code="invalid_body")
        try:
            parsed = model.model_validate_json(body)
        except ValidationError as error:
            raise validation_error(error) from None
        parsed.check()
        return parsed

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        vocab = self.scheduler.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", param="prompt",
                          code="invalid_value")
        return list(prompt)

    def _max_tokens(self, prompt_tokens: int, requested: int | None, default: int | None, param: str,
                    prompt_param: str) -> int:
        """The generated ids' budget, or a 400 where the prompt (with the max_tokens asked for) overflows the
        context."""
        room = self.max_length - prompt_tokens
        if room < 1:
            raise invalid(f"the prompt has {prompt_tokens} tokens, which leaves no room to generate within this "
                          f"model's context of {self.max_length} tokens", param=prompt_param,
                          code="context_length_exceeded")
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise invalid(f"this model's context is {self.max_length} tokens, but {prompt_tokens + requested} "
                          f"were requested ({prompt_tokens} in the prompt, {requested} for the completion): "
                          f"lower {param} or shorten the prompt", param=param, code="context_length_exceeded")
        return requested

    def _submit(self, body, prompts: list[list[int]], budgets: list[int], logprobs: int | None,
                arrival: float) -> Job:
        seed = body.request_seed()
        stop_ids = frozenset(body.stop_token_ids or ()) | (frozenset() if body.ignore_eos else self.eos_token_ids)
        sequences = []
        for prompt_index, (ids, budget) in enumerate(zip(prompts, budgets)):
            for choice in range(body.n):
                index = prompt_index * body.n + choice
                sequences.append(Sequence(ids, body.sampling_params(index, seed), budget, stop_ids, logprobs,
                                          index=index, arrival_time=arrival))
        if len(sequences) > self.scheduler.capacity:
            raise invalid(f"n: {len(sequences)} sequences (prompts times n) can never fit: this server holds "
                          f"{self.scheduler.capacity} at once ({self.scheduler.max_num_seqs} running, "
                          f"{self.scheduler.max_queue} waiting)", param="n")
        job = Job(self, sequences, body.stop, sum(len(ids) for ids in prompts))
        try:
            self.scheduler.submit(sequences)
        except QueueFull as error:
            raise APIError(429, str(error), code="queue_full") from None
        except ShuttingDown as error:
            raise APIError(503, str(error), code="shutting_down") from None
        except ValueError as error:
            raise invalid(str(error)) from None
        return job

    async def _gather(self, request: Request, job: Job) -> None:
        """Wait for every choice to end; a client that goes away meanwhile ends the wait (ClientDisconnected)."""
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.receiver.put_nowait(DISCONNECTED)

        watcher = asyncio.create_task(watch())
        try:
            async for _ in job.updates():
                pass
        finally:
            watcher.cancel()
            job.close()

    # ---- logprobs -------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if token_id < self.tokenizer.vocab_size else ""

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.tokenizer.token_bytes(token_id)) if token_id < self.tokenizer.vocab_size else []

    def completion_logprobs(self, entries: list) -> CompletionLogprobs:
        """OpenAI's legacy shape: the top dict holds the likeliest ids and the chosen one."""
        result = CompletionLogprobs()
        for token_id, logprob, top, offset in entries:
            result.tokens.append(self.token_text(token_id))
            result.token_logprobs.append(logprob)
            result.top_logprobs.append({self.token_text(t): p for t, p in [*top, (token_id, logprob)]})
            result.text_offset.append(offset)
        return result

    def chat_logprobs(self, entries: list) -> ChatLogprobs:
        return ChatLogprobs(content=[
            ChatLogprob(token=self.token_text(token_id), logprob=logprob, bytes=self.token_bytes(token_id),
                        top_logprobs=[TopLogprob(token=self.token_text(t), logprob=p, bytes=self.token_bytes(t))
                                      for t, p in top])
            for token_id, logprob, top, _ in entries
        ])

    # ---- responses ------------------------------------------------------------------------------
    def _stream(self, body, job: Job, opening: list[str], chunk, usage_chunk) -> EventStream:
        """The SSE response: the opening events, one chunk per output that releases text or log-probabilities or
        ends a choice (with the usage so far, when asked for continuous usage), the usage chunk when asked for,
        [DONE]; an error of the engine as an error event."""
        continuous = body.continuous_usage

        async def events():
            try:
                for event in opening:
                    yield event
                async for choice, piece, entries in job.updates():
                    if piece or entries or choice.finish_reason:
                        yield chunk(choice, piece, entries, job.usage() if continuous else None)
                if body.include_usage:
                    yield usage_chunk(job.usage())
            except APIError as error:
                yield sse(error.body())
            finally:
                job.close()
            yield "data: [DONE]\n\n"

        return EventStream(events(), job)

    @staticmethod
    def _in_order(job: Job) -> list[Choice]:
        return sorted(job.choices.values(), key=lambda choice: choice.index)

    # ---- POST /v1/completions -------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        body: CompletionRequest = await self.parse(request, CompletionRequest)
        self.check_model(body.model)
        prompts = [self._prompt_ids(prompt) for prompt in body.prompt]
        budgets = [self._max_tokens(len(ids), body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens", "prompt")
                   for ids in prompts]
        job = self._submit(body, prompts, budgets, body.logprobs, arrival)
        request_id, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())

        def response(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
            return CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                      usage=usage)

        def logprobs(entries):
            return self.completion_logprobs(entries) if body.logprobs is not None else None

        if body.stream:
            return self._stream(
                body, job, [],
                lambda choice, piece, entries, usage: sse(response([CompletionChoice(
                    index=choice.index, text=piece, logprobs=logprobs(entries), finish_reason=choice.finish_reason)],
                    usage)),
                lambda usage: sse(response([], usage)))
        await self._gather(request, job)
        return JSONResponse(response([CompletionChoice(index=c.index, text=c.text, logprobs=logprobs(c.logprobs),
                                                       finish_reason=c.finish_reason) for c in self._in_order(job)],
                                     job.usage()).model_dump())

    # ---- POST /v1/chat/completions --------------------------------------------------------------
    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        try:
            messages = [message.template_message() for message in body.messages]
            text = self.llm.chat_prompt(messages, body.chat_template_kwargs)
        except (ValueError, TypeError, jinja2.TemplateError) as error:
            raise invalid(f"messages: {error}", param="messages") from None
        return self.tokenizer.encode(text)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        body: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        self.check_model(body.model)
        prompt = self.chat_prompt(body)
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        budget = self._max_tokens(len(prompt), body.requested_max_tokens, None, param, "messages")
        job = self._submit(body, [prompt], [budget], body.top_logprob_count, arrival)
        request_id, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices,
                                           usage=usage))

        def logprobs(entries):
            return self.chat_logprobs(entries) if body.logprobs else None

        if body.stream:
            opening = chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))
                             for index in sorted(job.choices)])
            return self._stream(
                body, job, [opening],
                lambda choice, piece, entries, usage: chunk([ChatChunkChoice(
                    index=choice.index, delta=ChatDelta(content=piece or None), logprobs=logprobs(entries),
                    finish_reason=choice.finish_reason)], usage),
                lambda usage: chunk([], usage))
        await self._gather(request, job)
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text), logprobs=logprobs(c.logprobs),
                              finish_reason=c.finish_reason) for c in self._in_order(job)]
        return JSONResponse(ChatCompletionResponse(id=request_id, created=created, model=self.model_name,
                                                   choices=choices, usage=job.usage()).model_dump())


# ---- the app ------------------------------------------------------------------------------------
def create_app(
    llm,
    *,
    scheduler: Scheduler | None = None,
    model_name: str | None = None,
    max_num_seqs: int | None = None,
    max_queue: int = 256,
    prefill_chunk: int = 512,
    max_prefill_tokens: int | None = None,
    drain_timeout: float = 30.0,
) -> FastAPI:
    """The OpenAI API over `llm` (an engine.llm.LLM: its tokenizer, chat template and backend).

    The app's lifespan starts the engine thread and stops it: at shutdown, sequences still in flight get
    `drain_timeout` seconds to finish before they are aborted. scheduler: one already built over llm.model
    (tests wrap the backend); else one is built with max_num_seqs (default: the LLM's max_batch), max_queue,
    prefill_chunk and max_prefill_tokens (scheduler.py). model_name: the name requests give as `model` (default:
    the checkpoint folder's name).
    """
    metrics = ServerMetrics()
    if scheduler is None:
        scheduler = Scheduler(llm.model, max_num_seqs=max_num_seqs, max_queue=max_queue, prefill_chunk=prefill_chunk,
                              max_prefill_tokens=max_prefill_tokens, metrics=metrics)
    else:
        scheduler.metrics = metrics
    metrics.add_gauge("running_sequences", "sequences holding a slot (prefilling or decoding)",
                      lambda: scheduler.running)
    metrics.add_gauge("waiting_sequences", "sequences waiting for a slot", lambda: scheduler.waiting_count)
    metrics.add_gauge("free_slots", "slots free for the next sequence",
                      lambda: scheduler.max_num_seqs - scheduler.running)
    service = OpenAIService(llm, scheduler, model_name or llm.path.name, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()

        def deliver(outputs):
            for sequence, output in outputs:
                sequence.receiver.put_nowait((sequence, output))

        scheduler.emit = lambda outputs: loop.call_soon_threadsafe(deliver, outputs)
        scheduler.start()
        # the start's heap frozen (heap.py; with the engine on a thread, the model's too), then every pause counted
        app.state.frozen_objects = heap.freeze_startup_heap()
        pauses = heap.Pauses(metrics.gc_pause).start()
        metrics.pauses.append(pauses)
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop, drain_timeout)
            pauses.close()
            metrics.pauses.remove(pauses)
            gc.unfreeze()  # the process goes on (a test's): what was frozen is collected again

    app = FastAPI(title="qwen-triton", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service, app.state.scheduler, app.state.metrics = service, scheduler, metrics

    def error_response(error: APIError) -> JSONResponse:
        if not isinstance(error, EngineError):
            outcome = {400: "invalid", 404: "not_found", 429: "rejected", 503: "rejected"}.get(error.status, "failed")
            metrics.requests.inc(outcome=outcome)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        messages = {404: f"no route {request.method} {request.url.path}",
                    405: f"{request.method} is not allowed on {request.url.path}"}
        message = messages.get(error.status_code, str(error.detail))
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return error_response(APIError(error.status_code, message, code=code))

    @app.exception_handler(RequestValidationError)
    async def request_error(request: Request, error: RequestValidationError):
        return error_response(invalid(str(error.errors()[0].get("msg", error))))

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):
        return error_response(APIError(500, f"the server failed: {type(error).__name__}: {error}"))

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            raise APIError(503, "the engine thread is not running", code="engine_down")
        if not scheduler.accepting:
            raise APIError(503, "the server is stopping", code="shutting_down")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text():
        await scheduler.refresh_metrics()
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[service.model_card()]).model_dump()

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        service.check_model(name)
        return service.model_card().model_dump()

    async def answer(route, request: Request):
        """The route's response; a failure that is not an APIError becomes a 500 here, so that the connection
        stays open (an exception reaching uvicorn closes it)."""
        try:
            return await route(request)
        except ClientDisconnected:
            return Response(status_code=499)
        except APIError:
            raise
        except Exception as error:
            logger.exception("a request failed")
            raise APIError(500, f"the server failed: {type(error).__name__}: {error}") from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(service.completions, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(service.chat_completions, request)

    return app
