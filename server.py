"""``hostswap serve``: an OpenAI-compatible HTTP endpoint over one program written by ``export-llm``.

FastAPI on uvicorn. Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (the tokenizer's
chat template), ``/v1/models``, each completion streamed as server-sent events or returned
whole; ``/health``; ``/metrics`` in Prometheus' text format.

One ``Engine`` owns the loaded program and runs it on a worker thread. A program exported with
``max_batch_size`` is batched continuously: requests take free slots between decode steps, a
newcomer's prompt is prefilled a chunk per step while the others keep decoding, and each step
advances every sequence in one weight pass. Otherwise one sequence runs at a time. Requests
wait in a bounded queue (a full queue answers 429) and each request's tokens go back to its
connection as they come. A client that disconnects frees its sequence at the next
token; on shutdown (SIGTERM) the server stops taking requests, lets uvicorn finish the running
responses, then cancels what still waits. Bad requests get OpenAI's error JSON with a 4xx
status, and the server goes on serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import queue
import signal
import socket
import threading
import time
import uuid

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from hostswap.runtime.expert_cache import DEFAULT_POLICY
from hostswap.sampling import SamplingError, SamplingParams
from hostswap.text_stream import TextStream

MAX_BODY_BYTES = 1 << 20  # a request body beyond this is refused with 413
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; a chat's is the rest of the context


class ApiError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Cancelled(Exception):
    """The client went away: stop generating."""


class _Stopped(Exception):
    """A stop string appeared: the completion ends before it."""


@dataclasses.dataclass
class Job:
    """One completion: what to generate, and the channel its events go back on."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    include_usage: bool = False  # a stream ends with a chunk of the usage alone (OpenAI's stream_options)

    def emit(self, kind: str, value=None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


@dataclasses.dataclass
class Metrics:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    refused_queue_full: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_tokens_per_second: float = 0.0  # of the last completion with two tokens or more
    bytes_streamed_per_step: float = 0.0  # of the last completion's decode steps
    peak_active: int = 0  # the most sequences decoded together so far


class Engine:
    """One ``Generator`` on a worker thread: jobs wait in a bounded queue and run one at a time."""

    def __init__(self, generator, tokenizer, *, max_queue: int):
        self.generator, self.tokenizer = generator, tokenizer
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.metrics = Metrics()
        self.active = 0
        self.closing = False
        self._worker = threading.Thread(target=self._work, name="hostswap-engine", daemon=True)
        self._worker.start()

    @property
    def max_seq_len(self) -> int:
        return self.generator.max_seq_len

    def submit(self, job: Job) -> None:
        if self.closing:
            raise ApiError(503, "the server is shutting down", kind="server_error")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            self.metrics.refused_queue_full += 1
            raise ApiError(429, f"the queue is full ({self.queue.maxsize} requests wait); retry later", kind="rate_limit_error") from None
        self.metrics.requests += 1

    def _work(self) -> None:
        if hasattr(self.generator, "step"):
            return self._work_batched()
        while True:
            job = self.queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                self.metrics.cancelled += 1
                continue
            self.active = 1
            self.metrics.peak_active = max(self.metrics.peak_active, 1)
            try:
                self._run(job)
            finally:
                self.active = 0

    def _run(self, job: Job) -> None:
        text = TextStream(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), job.stop)
        count = 0

        def on_token(token: int) -> None:
            nonlocal count
            if job.cancelled.is_set():
                raise _Cancelled
            count += 1
            delta, stopped = text.push(token)
            if delta:
                job.emit("text", delta)
            if stopped:
                raise _Stopped

        finish, stopped = "length", False
        try:
            self.generator.generate(torch.tensor([job.prompt_ids]), job.max_tokens, on_token=on_token, sampling=job.sampling)
            if count < job.max_tokens:
                finish = "stop"  # an end-of-sequence token
        except _Stopped:
            finish, stopped = "stop", True
        except _Cancelled:
            self.metrics.cancelled += 1
            return
        except Exception as e:  # noqa: BLE001 - the request fails, the server goes on
            job.emit("error", ApiError(500, f"generation failed: {type(e).__name__}: {e}", kind="server_error"))
            return
        stats = self.generator.last
        if stats.tokens_per_second is not None:
            self.metrics.decode_tokens_per_second = stats.tokens_per_second
            self.metrics.bytes_streamed_per_step = stats.bytes_streamed_per_token or 0.0
        self.active = 0  # before the final event: a client that reads the metrics once its response ends sees it gone
        self._finish(job, text, finish, count, stopped)

    def _finish(self, job: Job, text: TextStream, finish: str, count: int, stopped: bool) -> None:
        """End ``job``'s completion of ``count`` tokens: the text held back (unless a stop string
        ended it: ``stopped``), the counters, and the final event with the usage."""
        rest = "" if stopped else text.rest()
        if rest:
            job.emit("text", rest)
        if text.stopped:  # a stop string the held-back end completed
            finish = "stop"
        self.metrics.completed += 1
        self.metrics.prompt_tokens += len(job.prompt_ids)
        self.metrics.generated_tokens += count
        job.emit("done", {"finish_reason": finish, "usage": {"prompt_tokens": len(job.prompt_ids), "completion_tokens": count,
                                                             "total_tokens": len(job.prompt_ids) + count}})

    def _work_batched(self) -> None:
        """Continuous batching: between decode steps, waiting jobs take free slots and every
        sequence still prefilling runs one more prompt chunk; each step advances all the
        others by one token, in one weight pass."""
        runner = self.generator
        running: dict[int, tuple[Job, TextStream, object]] = {}  # slot -> (job, its text, its sequence)
        stopping = False
        window: list[tuple[float, int, int]] = []  # (seconds, tokens, bytes) of the last steps
        while True:
            while not stopping and runner.free_slots():
                try:
                    job = self.queue.get(block=not running)
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                if job.cancelled.is_set():
                    self.metrics.cancelled += 1
                    continue
                try:
                    sequence = runner.begin(job.prompt_ids, job.max_tokens, sampling=job.sampling)
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    job.emit("error", ApiError(400 if isinstance(e, ValueError) else 500, f"{type(e).__name__}: {e}"))
                    continue
                running[sequence.slot] = (job, TextStream(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), job.stop), sequence)
            try:
                self._advance(runner, running, stopping, window)
            except Exception as e:  # noqa: BLE001 - a failed step fails the sequences in it; the server goes on
                for slot, (job, _, sequence) in list(running.items()):
                    runner.release(sequence)
                    job.emit("error", ApiError(500, f"generation failed: {type(e).__name__}: {e}", kind="server_error"))
                running.clear()
            self.active = len(running)
            self.metrics.peak_active = max(self.metrics.peak_active, self.active)
            if stopping and not running:
                return

    def _advance(self, runner, running: dict, stopping: bool, window: list) -> None:
        """Drop the cancelled sequences, run one more prompt chunk for each still prefilling,
        then one decode step for all the others."""
        if stopping:
            for job, _, sequence in running.values():
                job.cancelled.set()
        for slot, (job, text, sequence) in list(running.items()):
            if job.cancelled.is_set():
                runner.release(sequence)
                del running[slot]
                self.metrics.cancelled += 1
            elif sequence.prefilled < len(sequence.prompt) and runner.prefill_next(sequence):
                self._took(running, slot, sequence.tokens[-1])
        if any(s.decoding for _, _, s in running.values()):
            start, copied = time.perf_counter(), runner.module.pool.stats.bytes_h2d
            stepped = runner.step()
            for sequence in stepped:
                self._took(running, sequence.slot, sequence.tokens[-1])
            window.append((time.perf_counter() - start, len(stepped), runner.module.pool.stats.bytes_h2d - copied))
            del window[:-32]  # the last 32 steps
            seconds = sum(w[0] for w in window)
            self.metrics.decode_tokens_per_second = sum(w[1] for w in window) / seconds if seconds > 0 else 0.0
            self.metrics.bytes_streamed_per_step = sum(w[2] for w in window) / len(window)

    def _took(self, running: dict, slot: int, token: int) -> None:
        """``token`` came for the sequence in ``slot``: release its text, end it where it ends."""
        job, text, sequence = running[slot]
        delta, stopped = text.push(token)
        if delta:
            job.emit("text", delta)
        if not (stopped or sequence.finished):
            return
        self.generator.release(sequence)
        del running[slot]
        self.active = len(running)  # before the final event: a client that reads the metrics once its response ends sees it gone
        self._finish(job, text, "stop" if stopped or token in sequence.eos else "length", len(sequence.tokens), stopped)

    def close(self) -> None:
        """Take no more jobs, cancel those waiting, and let the worker end after the running one."""
        self.closing = True
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled.set()
                job.emit("error", ApiError(503, "the server shut down before this request ran", kind="server_error"))
        self.queue.put(None)
        self._worker.join()

    def prometheus(self) -> str:
        m = self.metrics
        rows = [
            ("requests_total", "counter", "completions accepted", m.requests),
            ("completed_total", "counter", "completions finished", m.completed),
            ("cancelled_total", "counter", "completions whose client went away", m.cancelled),
            ("refused_queue_full_total", "counter", "requests answered 429", m.refused_queue_full),
            ("prompt_tokens_total", "counter", "prompt tokens prefilled", m.prompt_tokens),
            ("generated_tokens_total", "counter", "tokens generated", m.generated_tokens),
            ("decode_tokens_per_second", "gauge", "steady-state decode speed of the last completion", m.decode_tokens_per_second),
            ("bytes_streamed_per_step", "gauge", "weight bytes copied to the device per decode step, last completion", m.bytes_streamed_per_step),
            ("queue_depth", "gauge", "requests waiting", self.queue.qsize()),
            ("active_sequences", "gauge", "sequences being generated", self.active),
            ("peak_active_sequences", "gauge", "the most sequences generated together so far", max(m.peak_active, self.active)),
        ]
        out = []
        for name, kind, help_text, value in rows:
            out += [f"# HELP hostswap_{name} {help_text}", f"# TYPE hostswap_{name} {kind}", f"hostswap_{name} {value}"]
        return "\n".join(out) + "\n"


# --- request parsing -------------------------------------------------------------------------

def _field(body: dict, name: str, kinds: tuple, default=None, required: bool = False):
    if name not in body or body[name] is None:
        if required:
            raise ApiError(400, f"'{name}' is required", param=name)
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in kinds:
        raise ApiError(400, f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got a boolean", param=name)
    if not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}", param=name)
    return value


def _sampling(body: dict) -> SamplingParams:
    temperature = float(_field(body, "temperature", (int, float), 0.0))
    top_p = float(_field(body, "top_p", (int, float), 1.0))
    try:
        return SamplingParams(temperature=temperature, top_k=_field(body, "top_k", (int,), 0), top_p=top_p,
                              repetition_penalty=float(_field(body, "repetition_penalty", (int, float), 1.0)), seed=_field(body, "seed", (int,)))
    except SamplingError as e:
        raise ApiError(400, str(e), param=str(e).split()[0]) from None


def _include_usage(body: dict) -> bool:
    options = _field(body, "stream_options", (dict,), {})
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' takes 'include_usage' (true or false) alone", param="stream_options")
    return options.get("include_usage", False)


def _stop(body: dict) -> tuple[str, ...]:
    stop = _field(body, "stop", (str, list), ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
    return stop


# Fields each endpoint reads; besides them, OpenAI fields accepted only at their neutral value
# (anything else would change the answer in a way this server does not: refused, not ignored).
# A field of neither kind is refused by name: a misspelt "temprature" must not sample greedily.
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop", "stream", "n",
                 "stream_options", "user"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}
NEUTRAL_VALUES = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "logprobs": (False, None),
                  "top_logprobs": (0, None), "echo": (False,), "suffix": (None, ""), "best_of": (1, None), "tools": ([], None),
                  "tool_choice": ("none", None), "response_format": ({"type": "text"},), "parallel_tool_calls": (True, False, None)}


def _check_fields(body: dict, fields: set[str]) -> None:
    for name, value in body.items():
        if name in fields:
            continue
        if name in NEUTRAL_VALUES:
            if not any(type(value) is type(v) and value == v for v in NEUTRAL_VALUES[name]):  # strict: 0 is not False
                raise ApiError(400, f"'{name}' is not supported by this server (only {NEUTRAL_VALUES[name][0]!r} is accepted)", param=name)
            continue
        raise ApiError(400, f"unrecognized request field '{name}'", param=name)


class Parser:
    """Turns request bodies into jobs, or ``ApiError`` naming the field at fault."""

    def __init__(self, engine: Engine, model_id: str):
        self.engine, self.model_id = engine, model_id

    def _model(self, body: dict) -> None:
        model = _field(body, "model", (str,), required=True)
        if model != self.model_id:
            raise ApiError(404, f"model '{model}' does not exist; this server serves '{self.model_id}'", param="model", code="model_not_found")

    def _job(self, body: dict, prompt_ids: list[int], loop, chat: bool = False) -> Job:
        limit = self.engine.max_seq_len
        if len(prompt_ids) >= limit:
            raise ApiError(400, f"the prompt is {len(prompt_ids)} tokens; this model's context is {limit} tokens (max_seq_len)", param="prompt",
                           code="context_length_exceeded")
        default = limit - len(prompt_ids) if chat else DEFAULT_MAX_TOKENS
        max_tokens = _field(body, "max_tokens", (int,), default)
        if "max_completion_tokens" in body:
            max_tokens = _field(body, "max_completion_tokens", (int,), default)
        if max_tokens < 1:
            raise ApiError(400, f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")
        if len(prompt_ids) + max_tokens > limit:
            raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds this model's context of {limit} "
                                f"tokens; ask for at most {limit - len(prompt_ids)}", param="max_tokens", code="context_length_exceeded")
        n = _field(body, "n", (int,), 1)
        if n != 1:
            raise ApiError(400, f"'n' must be 1 (one completion per request), got {n}", param="n")
        return Job(prompt_ids, max_tokens, _sampling(body), _stop(body), loop, asyncio.Queue(), include_usage=_include_usage(body))

    def completion(self, body: dict, loop) -> Job:
        _check_fields(body, COMPLETION_FIELDS)
        self._model(body)
        prompt = _field(body, "prompt", (str, list), required=True)
        if isinstance(prompt, list):
            if len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                vocab = self.engine.generator.vocab_size
                bad = next((t for t in prompt if not 0 <= t < vocab), None)
                if bad is not None:
                    raise ApiError(400, f"'prompt' holds token id {bad}, outside the vocabulary of {vocab} ids", param="prompt")
                return self._job(body, list(prompt), loop)
            else:
                raise ApiError(400, "'prompt' must be a string, a list of one string, or a non-empty list of token ids", param="prompt")
        ids = self.engine.tokenizer(prompt).input_ids if prompt else []
        if not ids:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        return self._job(body, ids, loop)

    def chat(self, body: dict, loop) -> Job:
        _check_fields(body, CHAT_FIELDS)
        self._model(body)
        messages = _field(body, "messages", (list,), required=True)
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects with string content", param="messages")
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, f"model '{self.model_id}' has no chat template; use /v1/completions", param="messages")
        ids = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return self._job(body, ids, loop, chat=True)


# --- the application -------------------------------------------------------------------------

def create_app(engine: Engine, model_id: str, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES):
    """The ASGI application serving ``engine`` as model ``model_id``."""
    app = FastAPI(title="hostswap", docs_url=None, redoc_url=None)
    parser = Parser(engine, model_id)

    def refuse(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return refuse(ApiError(401, "a valid API key is required: Authorization: Bearer <key>", kind="authentication_error", code="invalid_api_key"))
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            return refuse(ApiError(413, f"the request body is {length} bytes; the limit is {max_body_bytes}"))
        return await call_next(request)

    async def body_of(request: Request) -> dict:
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_body_bytes:
                raise ApiError(413, f"the request body exceeds the limit of {max_body_bytes} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        return body

    async def serve(request: Request, parse, kind: str):
        try:
            body = await body_of(request)
            job = parse(body, asyncio.get_running_loop())
            stream = _field(body, "stream", (bool,), False)
            engine.submit(job)
        except ApiError as e:
            return refuse(e)
        if stream:
            return StreamingResponse(_events(job, kind, model_id), media_type="text/event-stream")
        try:
            return JSONResponse(await _whole(job, kind, model_id))
        except ApiError as e:
            return refuse(e)
        finally:
            job.cancelled.set()  # a client that went away mid-request frees its sequence

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, parser.completion, "text")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, parser.chat, "chat")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "hostswap"}]}

    @app.get("/health")
    async def health():
        return {"status": "shutting down" if engine.closing else "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.prometheus(), media_type="text/plain; version=0.0.4")

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return refuse(ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc):
        return refuse(ApiError(405, f"{request.url.path} does not take {request.method}"))

    return app


def _chunk(job: Job, kind: str, model_id: str, text: str | None, finish: str | None, first: bool = False) -> dict:
    usage = {"usage": None} if job.include_usage else {}  # OpenAI's chunks before the usage's, where it is asked for
    if kind == "chat":
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"id": f"chatcmpl-{job.id}", "object": "chat.completion.chunk", "created": job.created, "model": model_id, "choices": [choice]} | usage
    return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created, "model": model_id,
            "choices": [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]} | usage


async def _events(job: Job, kind: str, model_id: str):
    """Server-sent events of one completion; a disconnect (the generator closed) cancels it."""
    try:
        if kind == "chat":
            yield f"data: {json.dumps(_chunk(job, kind, model_id, None, None, first=True))}\n\n"
        while True:
            event, value = await job.events.get()
            if event == "text":
                yield f"data: {json.dumps(_chunk(job, kind, model_id, value, None))}\n\n"
            elif event == "error":
                yield f"data: {json.dumps(value.body())}\n\n"
                break
            else:
                yield f"data: {json.dumps(_chunk(job, kind, model_id, None, value['finish_reason']))}\n\n"
                if job.include_usage:  # as OpenAI sends it: a last chunk of no choices
                    usage = _chunk(job, kind, model_id, None, None) | {"choices": [], "usage": value["usage"]}
                    yield f"data: {json.dumps(usage)}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()


async def _whole(job: Job, kind: str, model_id: str) -> dict:
    parts = []
    while True:
        event, value = await job.events.get()
        if event == "text":
            parts.append(value)
        elif event == "error":
            raise value
        else:
            break
    text = "".join(parts)
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": value["finish_reason"], "logprobs": None}
        return {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": job.created, "model": model_id, "choices": [choice], "usage": value["usage"]}
    return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created, "model": model_id,
            "choices": [{"index": 0, "text": text, "finish_reason": value["finish_reason"], "logprobs": None}], "usage": value["usage"]}


def _check_port_free(host: str, port: int) -> None:
    """Bind every address ``host`` names on ``port`` as asyncio's server does (uvicorn's), then
    let go: an address in use is refused before the load."""
    try:
        addresses = {(family, address) for family, _, _, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)}
        for family, address in addresses:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's port is free
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # the IPv4 side is its own address
                probe.bind(address)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}; give another --port or --host") from None


def serve(base: str, *, budget_mb: float | str = "auto", device: str = "cuda", host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, max_queue: int = 64, model_id: str | None = None, graceful_seconds: float = 30.0,
          on_ready=None, expert_prefetch: int = 0, compiled: bool = False, expert_host_cache_mb: float | str = "auto",
          expert_cache_policy: str = DEFAULT_POLICY) -> None:
    """Load ``<base>.pte``/``.ptd`` and its tokenizer (``<base>.tokenizer``) and serve them until
    SIGTERM or SIGINT. ``expert_prefetch``, ``expert_host_cache_mb``, ``expert_cache_policy``: as ``Module`` takes them;
    ``compiled``: decode runs as one TorchInductor graph (``Module``'s ``compiled=("decode",)``)."""
    import os

    import uvicorn
    from transformers import AutoTokenizer

    from hostswap import batching, llm

    if not math.isfinite(float(port)) or not 0 <= int(port) < 65536:
        raise ValueError(f"port must be 0..65535, got {port}")
    if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
        raise ValueError(f"max_queue must be a positive int, got {max_queue!r}")
    if int(port):  # before the load, which for a large model takes minutes
        _check_port_free(host, int(port))
    from hostswap import tensor_parallel

    program, rank, device = tensor_parallel.rank_program(base, device)  # under torchrun: this rank's program and GPU
    if not os.path.isfile(program + ".pte"):
        raise FileNotFoundError(f"no program at {program}.pte: give the path prefix export-llm wrote (its --out)")
    tokenizer_dir = base + ".tokenizer"
    if not os.path.isdir(tokenizer_dir):
        raise FileNotFoundError(f"no tokenizer at {tokenizer_dir}: export-llm saves the checkpoint's tokenizer there; the server needs it to read prompts")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    batched = batching.is_batched(program + ".pte")  # continuous batching over the program's slots
    generator = (batching.BatchGenerator if batched else llm.Generator)(program + ".pte", program + ".ptd", weight_offload_budget_mb=budget_mb,
                                                                        device=device, expert_prefetch=expert_prefetch,
                                                                        compiled=(llm.DECODE,) if compiled else False, expert_host_cache_mb=expert_host_cache_mb,
                                                                        expert_cache_policy=expert_cache_policy)
    if program != base:  # tensor parallel: rank 0 serves, the others generate what it sends them
        group = tensor_parallel.control_group()
        if rank != 0:
            # rank 0 ends the service (it drains its requests first) and then tells the others:
            # a signal here would break a collective rank 0 still runs
            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_IGN)
            try:
                (tensor_parallel.follow_batch if batched else tensor_parallel.follow)(generator, group)
            finally:
                generator.close()
            return
        generator = (tensor_parallel.LeadBatchGenerator if batched else tensor_parallel.LeadGenerator)(generator, group)
    engine = Engine(generator, tokenizer, max_queue=max_queue)
    model_id = model_id or os.path.basename(base)
    app = create_app(engine, model_id, api_key=api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=graceful_seconds)
    server = uvicorn.Server(config)
    if on_ready is not None:
        on_ready(generator)
    # uvicorn drains on SIGTERM/SIGINT, then raises the signal again for the handler it found:
    # make that one a no-op, so the engine and the program close below and the exit is clean
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        engine.close()
        generator.close()
