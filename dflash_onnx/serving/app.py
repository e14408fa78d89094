"""The OpenAI-compatible HTTP API over an Engine (FastAPI): /v1/chat/completions, /v1/completions, /v1/models,
/health; streaming as server-sent events. Handlers never touch ONNX Runtime: they queue requests on the engine
and wait on its events in a worker thread, so the event loop stays free."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.sampling import SamplingParams
from dflash_onnx.serving.engine import Engine, Event, GenerationRequest, QueueFull, Submission
from dflash_onnx.serving.protocol import ChatRequest, CompletionRequest, error_body

POLL_S = 0.25  # how often a waiting handler looks for a disconnected client


@dataclass(frozen=True)
class ServerOptions:
    model: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_tokens: int = 512  # a chat request's default when it names none
    temperature: float = 0.0  # a request's default when it names none: greedy, the target's own output


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


class _Events:
    """A submission's events awaited on the event loop (no thread held while waiting), cancelling it when its
    client has gone: the connection is looked at every POLL_S, also while events keep coming."""

    def __init__(self, submission: Submission, request: Request):
        self.submission, self.request = submission, request
        self.queue = submission.attach(asyncio.get_running_loop())
        self.looked = time.monotonic()

    async def next(self) -> Event:
        while True:
            if time.monotonic() - self.looked >= POLL_S:
                self.looked = time.monotonic()
                if await self.request.is_disconnected():
                    self.submission.cancel()
            try:
                return await asyncio.wait_for(self.queue.get(), POLL_S)
            except asyncio.TimeoutError:
                continue


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


def create_app(engine: Engine, options: ServerOptions) -> FastAPI:
    app = FastAPI(title="dflash-onnx", docs_url=None, redoc_url=None)
    created = int(time.time())

    app.add_middleware(_Guard, options=options)

    @app.get("/health")
    async def health():
        return {"status": "ok", "waiting": engine.waiting, "finished": dict(engine.finished)}

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
        try:
            raw = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"the request body is not valid JSON ({exc})")
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

    def submit(prompt_ids: list[int], max_tokens: int, parsed) -> Submission | JSONResponse:
        try:
            return engine.submit(GenerationRequest(prompt_ids, max_tokens, sampling(parsed), tuple(parsed.stop or ())))
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
                submission.cancel()
            if event.error:
                return _error(500, f"generation failed: {event.error}", "server_error")
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
                        if event.finish != "cancelled":
                            yield chunk([choice("", event.finish, True)])
                            if include_usage:  # as the OpenAI API sends it: a last chunk without choices
                                yield chunk([], usage=usage(event.completion_tokens))
                        break
                yield "data: [DONE]\n\n"
            finally:  # the client went away mid-stream: its request stops at its next step
                submission.cancel()

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
        submission = submit(prompt, parsed.max_tokens or 16, parsed)
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
        submission = submit(prompt, max_tokens, parsed)
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
