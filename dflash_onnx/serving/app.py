"""The OpenAI-compatible HTTP API over an Engine (FastAPI): /v1/chat/completions, /v1/completions, /v1/models,
/health; streaming as server-sent events. Handlers never touch ONNX Runtime: they queue requests on the engine
and await its events on the event loop, so the event loop stays free. Bodies are read within limits (size, nesting
depth) before a parser sees them; each request ends in one access-log line; the requests under way are kept
(`InFlight`) so that a shutdown can let them finish or cancel them."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.sampling import SamplingParams
from dflash_onnx.serving.engine import Engine, Event, GenerationRequest, QueueFull, Submission
from dflash_onnx.serving.protocol import ChatRequest, CompletionRequest, error_body, too_deep

POLL_S = 0.25  # how often a waiting handler looks for a disconnected client
ACCESS = "dflash.access"  # the scope key of a request's access-log record (handlers add tokens, tau, TTFT)
LOG_FORMATS = ("text", "json")
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # an escaped UTF-16 surrogate: lone ones are not text


@dataclass(frozen=True)
class ServerOptions:
    model: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_tokens: int = 512  # a chat request's default when it names none
    temperature: float = 0.0  # a request's default when it names none: greedy, the target's own output
    max_depth: int = 64  # arrays and objects nested deeper in a body get 400 (OpenAI bodies nest a few levels)
    access_log: str | None = None  # "text" or "json": one line per request on stderr; None: none


class InFlight:
    """The generation requests this app queued on the engine and has not seen end, for a shutdown: once
    `draining`, new requests get 503; `cancel` stops those still under way at their next step."""

    def __init__(self):
        self._submissions: set[Submission] = set()
        self.draining = False

    def add(self, submission: Submission) -> None:
        self._submissions = {s for s in self._submissions if not s.ended}
        self._submissions.add(submission)

    def __len__(self) -> int:
        self._submissions = {s for s in self._submissions if not s.ended}
        return len(self._submissions)

    def under_way(self) -> list[Submission]:
        return [s for s in self._submissions if not s.ended]

    def cancel(self) -> int:
        """Cancel every request under way; returns how many."""
        under_way = self.under_way()
        for submission in under_way:
            submission.cancel()
        return len(under_way)


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


class _Events:
    """A submission's events awaited on the event loop (no thread held while waiting), cancelling it when its
    client has gone: the connection is looked at every POLL_S, also while events keep coming. The access-log record
    gets the time to the first token and, from the last event, the tokens, tau and finish reason."""

    def __init__(self, submission: Submission, request: Request):
        self.submission, self.request = submission, request
        self.record = request.scope.setdefault(ACCESS, {"start": time.perf_counter()})
        self.queue = submission.attach(asyncio.get_running_loop())
        self.looked = time.monotonic()

    async def next(self) -> Event:
        while True:
            if time.monotonic() - self.looked >= POLL_S:
                self.looked = time.monotonic()
                if await self.request.is_disconnected():
                    self.submission.cancel()
            try:
                event = await asyncio.wait_for(self.queue.get(), POLL_S)
            except asyncio.TimeoutError:
                continue
            if event.completion_tokens and "ttft_s" not in self.record:
                self.record["ttft_s"] = time.perf_counter() - self.record["start"]
            self.record.update(completion_tokens=event.completion_tokens, tau=event.tau)
            if event.finish or event.error:
                self.record["finish"] = "error" if event.error else event.finish
            return event

    def close(self) -> None:
        """The response is done with the request: cancelled if it has not ended (its client left)."""
        self.submission.cancel()
        self.record.setdefault("finish", "cancelled")


def _access_line(record: dict, scope: dict, status: int, form: str) -> str:
    """The request's access-log line: plain text (key=value after method, path and status; - where a value does
    not apply) or one JSON object."""
    client = scope.get("client")
    fields = {"time": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
              "client": (f"[{client[0]}]:{client[1]}" if ":" in client[0] else f"{client[0]}:{client[1]}")
              if client else None, "method": scope.get("method"),
              "path": quote(scope.get("path", ""), safe="/:@!$&'()*+,;=-._~"), "status": status,
              "prompt_tokens": record.get("prompt_tokens"), "completion_tokens": record.get("completion_tokens"),
              "tau": None if record.get("tau") is None else round(record["tau"], 2),
              "ttft_ms": None if "ttft_s" not in record else round(1000 * record["ttft_s"], 1),
              "total_ms": round(1000 * (time.perf_counter() - record["start"]), 1), "finish": record.get("finish")}
    if form == "json":
        return json.dumps(fields)
    head = " ".join(str(fields.pop(key) or "-") for key in ("time", "client", "method", "path", "status"))
    return head + "".join(f" {key}={'-' if value is None else value}" for key, value in fields.items())


class _AccessLog:
    """One line per request on stderr once its response is sent (a stream: once it ended), with what the handler
    recorded; plain ASGI, outside the other middleware, so refusals (401, 413) are logged too."""

    def __init__(self, app, options: ServerOptions):
        self.app, self.options = app, options

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = scope[ACCESS] = {"start": time.perf_counter()}
        status = 500  # where a defect raises before a response starts, the 500 sent for it

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if self.options.access_log:
                sys.stderr.write(_access_line(record, scope, status, self.options.access_log) + "\n")
                sys.stderr.flush()


class _Guard:
    """The API key and the declared body size, checked before a route runs. A plain ASGI middleware: Starlette's
    BaseHTTPMiddleware would keep a route from seeing its client disconnect."""

    def __init__(self, app, options: ServerOptions):
        self.app, self.options = app, options

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.decode("latin-1").lower(): value for name, value in scope.get("headers", [])}
        refusal = None
        if self.options.api_key and scope["path"].startswith("/v1/"):
            given = headers.get("authorization", b"")
            if not secrets.compare_digest(given, f"Bearer {self.options.api_key}".encode()):
                refusal = _error(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                 "authentication_error", code="invalid_api_key")
        length = headers.get("content-length", b"").decode("latin-1")
        if refusal is None and length.isdigit() and int(length) > self.options.max_body_bytes:
            refusal = _error(413, f"the request body is over {self.options.max_body_bytes} bytes",
                             code="request_too_large")
        if refusal is not None:
            return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)


def _json_kind(value) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


def create_app(engine: Engine, options: ServerOptions) -> FastAPI:
    """The app; `app.state.in_flight` holds its requests under way (InFlight), for a server that shuts down."""
    if options.access_log not in (None, *LOG_FORMATS):
        raise ValueError(f"access_log must be one of {LOG_FORMATS} or None, got {options.access_log!r}")
    app = FastAPI(title="dflash-onnx", docs_url=None, redoc_url=None)
    created = int(time.time())
    in_flight = app.state.in_flight = InFlight()

    app.add_middleware(_Guard, options=options)
    app.add_middleware(_AccessLog, options=options)  # added last: the outermost

    @app.get("/health")
    async def health():
        body = {"status": "shutting down" if in_flight.draining else "ok", "waiting": engine.waiting,
                "finished": dict(engine.finished)}
        return JSONResponse(body, status_code=503) if in_flight.draining else body

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": options.model, "object": "model", "created": created,
                                            "owned_by": "dflash-onnx"}]}

    async def parse(request: Request, kind):
        parts, size = [], 0
        async for part in request.stream():  # a chunked body has no Content-Length: counted as it arrives
            size += len(part)
            if size > options.max_body_bytes:
                return _error(413, f"the request body is over {options.max_body_bytes} bytes",
                              code="request_too_large")
            parts.append(part)
        body = b"".join(parts)
        depth = too_deep(body, options.max_depth)  # before json.loads, which recurses once a level
        if depth is not None:
            return _error(400, f"the request body nests arrays and objects {depth} deep: at most "
                          f"{options.max_depth} levels are read", code="nesting_too_deep")
        try:
            raw = json.loads(body)
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or a number past Python's digits
            return _error(400, f"the request body is not valid JSON ({str(exc).split(';')[0]})")
        if not isinstance(raw, dict):
            return _error(400, f"the request body must be a JSON object, got {_json_kind(raw)}")
        if _SURROGATE.search(body):  # an escaped surrogate: a lone one is no text a tokenizer takes
            try:
                json.dumps(raw, ensure_ascii=False).encode()
            except UnicodeEncodeError as exc:
                return _error(400, f"the request body holds a lone UTF-16 surrogate "
                              f"({exc.object[exc.start:exc.end].encode('unicode_escape').decode()}): not text")
        try:
            parsed = kind.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            return _error(422, f"{where}: {first['msg']}", param=where)
        unsupported = parsed.unsupported()
        if unsupported:
            return _error(400, f"{unsupported} is not supported by this server", param=unsupported)
        if parsed.model not in (None, options.model):
            return _error(404, f"the model {parsed.model!r} does not exist: this server serves {options.model!r}",
                          param="model", code="model_not_found")
        return parsed

    def sampling(parsed) -> SamplingParams:
        temperature = options.temperature if parsed.temperature is None else parsed.temperature
        return SamplingParams(temperature, parsed.top_p or 1.0, parsed.top_k or 0, parsed.seed)

    def submit(request: Request, prompt_ids: list[int], max_tokens: int, parsed) -> Submission | JSONResponse:
        request.scope.setdefault(ACCESS, {"start": time.perf_counter()})["prompt_tokens"] = len(prompt_ids)
        if in_flight.draining:
            return _error(503, "the server is shutting down: send the request to another server or retry later",
                          "server_error", code="shutting_down")
        try:
            submission = engine.submit(GenerationRequest(prompt_ids, max_tokens, sampling(parsed),
                                                         tuple(parsed.stop or ())))
            in_flight.add(submission)
            return submission
        except QueueFull:
            return _error(429, "the server's queue is full: retry later", "rate_limit_error",
                          code="queue_full", headers={"Retry-After": "1"})
        except DFlashError as exc:
            code = "context_length_exceeded" if "exceed" in str(exc) else None
            return _error(400, str(exc), code=code)

    async def respond(request: Request, submission: Submission, chat: bool, parsed, prompt_tokens: int):
        ident, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        events = _Events(submission, request)

        def shutting_down(event: Event) -> str:
            when = f"after {event.completion_tokens} tokens" if event.completion_tokens else "before its first token"
            return f"the server is shutting down: the request was cancelled {when}"

        def usage(completion: int) -> dict:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion}

        def choice(text: str, finish: str | None, stream: bool) -> dict:
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            body = {"role": "assistant", "content": text} if not stream else ({"content": text} if text else {})
            return {"index": 0, "delta" if stream else "message": body, "logprobs": None, "finish_reason": finish}

        if not parsed.stream:
            texts, event = [], None
            try:
                while True:
                    event = await events.next()
                    texts.append(event.text)
                    if event.finish or event.error:
                        break
            finally:
                events.close()
            if event.error:
                return _error(500, f"generation failed: {event.error}", "server_error")
            if event.finish == "cancelled" and in_flight.draining:
                return _error(503, shutting_down(event), "server_error", code="shutting_down")
            return {"id": ident, "object": kind, "created": created, "model": options.model,
                    "choices": [choice("".join(texts), event.finish, False)], "usage": usage(event.completion_tokens)}

        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(((parsed.model_extra or {}).get("stream_options") or {}).get("include_usage"))

        def line(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        def chunk(choices: list[dict], **extra) -> str:
            return line({"id": ident, "object": chunk_kind, "created": created, "model": options.model,
                         "choices": choices, **extra})

        async def stream() -> AsyncIterator[str]:
            try:
                if chat:
                    yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                while True:
                    event = await events.next()
                    if event.error:
                        yield line(error_body(f"generation failed: {event.error}", "server_error"))
                        break
                    if event.text:
                        yield chunk([choice(event.text, None, True)])
                    if event.finish:
                        if event.finish == "cancelled" and in_flight.draining:  # ended by a shutdown: said so
                            yield line(error_body(shutting_down(event), "server_error", code="shutting_down"))
                        elif event.finish != "cancelled":
                            yield chunk([choice("", event.finish, True)])
                            if include_usage:  # as the OpenAI API sends it: a last chunk without choices
                                yield chunk([], usage=usage(event.completion_tokens))
                        break
                yield "data: [DONE]\n\n"
            finally:  # the client went away mid-stream: its request stops at its next step
                events.close()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        parsed = await parse(request, CompletionRequest)
        if isinstance(parsed, JSONResponse):
            return parsed
        try:
            prompt = parsed.prompt if isinstance(parsed.prompt, list) else engine.codec.encode(parsed.prompt)
        except DFlashError as exc:
            return _error(400, str(exc))
        if not prompt:
            return _error(400, "the prompt is empty", param="prompt")
        submission = submit(request, prompt, parsed.max_tokens or 16, parsed)
        if isinstance(submission, JSONResponse):
            return submission
        return await respond(request, submission, False, parsed, len(prompt))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        parsed = await parse(request, ChatRequest)
        if isinstance(parsed, JSONResponse):
            return parsed
        messages = [{"role": m.role, "content": m.text()} for m in parsed.messages]
        try:
            prompt = engine.codec.chat_ids(messages)
        except DFlashError as exc:
            return _error(400, str(exc), param="messages")
        max_tokens = parsed.max_completion_tokens or parsed.max_tokens or options.max_tokens
        submission = submit(request, prompt, max_tokens, parsed)
        if isinstance(submission, JSONResponse):
            return submission
        return await respond(request, submission, True, parsed, len(prompt))

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):  # a defect of ours: said in one line, never a traceback
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return _error(404, f"no route {request.method} {request.url.path}", code="not_found")

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc):
        return _error(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")

    return app
