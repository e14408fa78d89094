"""One engine thread that owns the decoder's sessions and runs the queued requests, one at a time.

The HTTP layer (app.py) and other hosts (Ray Serve, Triton's Python backend) call `Engine.submit`, never ORT: a
request waits in a bounded queue, then the engine thread decodes it with DFlash (`--verify auto`: never slower
than greedy) and puts its text deltas on the request's own queue. A cancelled request (a client gone) stops at its
next decoding step. Requests run one after another; batched DFlash is not built yet.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from runtime.decode import Decoder
from runtime.errors import DFlashError
from runtime.sampling import SamplingParams
from runtime.tokenizer import TextCodec


class QueueFull(Exception):
    """The engine's queue holds --max-queue requests already."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # strings that end the text (left out of it)


@dataclass
class Event:
    """`text`: new text (empty on the last event). On the last event `finish` is "stop" (a stop token or string),
    "length" (max_tokens) or "cancelled", or `error` says what went wrong; `completion_tokens` counts the tokens
    generated so far."""

    text: str
    completion_tokens: int
    finish: str | None = None
    error: str | None = None


class Submission:
    """One request's handle: iterate it for its events (the engine thread fills them), or `attach` an event loop
    and await them; `cancel` stops it at its next decoding step (before its prefill if it has not started)."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.events: queue.Queue[Event] = queue.Queue()
        self.cancelled = threading.Event()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async: asyncio.Queue[Event] | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, event: Event) -> None:
        """The engine thread's side: to the attached event loop's queue, else to the thread-safe one."""
        with self._lock:
            if self._loop is None:
                self.events.put(event)
            else:
                self._loop.call_soon_threadsafe(self._async.put_nowait, event)

    def attach(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[Event]:
        """From now on the events go to an asyncio queue on `loop` (those already put move there first): a
        handler awaits them without holding a thread."""
        events: asyncio.Queue[Event] = asyncio.Queue()
        with self._lock:
            while not self.events.empty():
                events.put_nowait(self.events.get_nowait())
            self._loop, self._async = loop, events
        return events

    def next_event(self, timeout: float | None = None) -> Event:
        return self.events.get(timeout=timeout)

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.next_event()
            yield event
            if event.finish is not None or event.error is not None:
                return


class _StopText:
    """The text a request may show so far: up to the first stop string, and holding back a tail that could be
    the start of one (a stream never shows text a later token turns into a stop string)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.shown = 0

    def advance(self, text: str, final: bool) -> tuple[str, bool]:
        """(the new text to show, whether a stop string ended the text)."""
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        if cut >= 0:
            delta, self.shown = text[self.shown : cut], max(self.shown, cut)
            return delta, True
        # not final: hold back what could begin a stop string, and a character still missing its other bytes
        end = len(text) if final else max(self.shown, len(text) - self.hold - text.endswith("\ufffd"))
        delta, self.shown = text[self.shown : end], end
        return delta, False


class Engine:
    """`submit(request) -> Submission`; the decoder is used by the engine thread alone."""

    def __init__(self, decoder: Decoder, codec: TextCodec, max_queue: int = 16, verify: str | int = "auto"):
        if max_queue < 1:
            raise DFlashError(f"--max-queue must be at least 1, got {max_queue}")
        self.decoder, self.codec, self.verify = decoder, codec, verify
        self.stop_token_ids = frozenset(decoder.stop_token_ids)
        self._queue: queue.Queue[Submission | None] = queue.Queue(maxsize=max_queue)
        self.finished: Counter[str] = Counter()  # requests ended, by finish reason ("error" for failures)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> Submission:
        """Queue `request`; raises QueueFull when --max-queue requests wait already. Arguments the decoder
        refuses (a prompt past the lowering's context, ids outside the vocabulary) raise DFlashError here."""
        self.decoder.check(request.prompt_ids, request.max_tokens, "dflash", request.sampling)
        submission = Submission(request)
        try:
            self._queue.put_nowait(submission)
        except queue.Full:
            raise QueueFull from None
        return submission

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        """Stop after the request under way; requests still queued end as cancelled."""
        self._stopping.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            try:
                submission = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._stopping.is_set():
                    return
                continue
            if self._stopping.is_set():
                submission.cancel()
            try:
                self.finished[self._decode(submission)] += 1
            except Exception as exc:  # one request's failure must not stop the engine for the others
                message = str(exc) if isinstance(exc, DFlashError) else f"{type(exc).__name__}: {exc}"
                submission.put(Event("", 0, error=message))
                self.finished["error"] += 1

    def _decode(self, submission: Submission) -> str:
        """Run one request, putting its events; returns its finish reason."""
        request = submission.request
        if submission.cancelled.is_set():  # its client left while it waited: no prefill for nobody
            submission.put(Event("", 0, finish="cancelled"))
            return "cancelled"
        steps = self.decoder.stream(request.prompt_ids, request.max_tokens, "dflash", request.sampling, None,
                                    self.verify)
        ids: list[int] = []
        shown = _StopText(request.stop)
        try:
            for chunk in steps:
                if submission.cancelled.is_set():
                    submission.put(Event("", len(ids), finish="cancelled"))
                    return "cancelled"
                ids.extend(chunk)
                ended = ids[-1] in self.stop_token_ids
                text = self.codec.decode(ids[:-1] if ended else ids)
                delta, stopped = shown.advance(text, ended or len(ids) >= request.max_tokens)
                if stopped or ended:
                    submission.put(Event(delta, len(ids)))
                    submission.put(Event("", len(ids), finish="stop"))
                    return "stop"
                if delta:
                    submission.put(Event(delta, len(ids)))
        finally:
            steps.close()
        delta, _ = shown.advance(self.codec.decode(ids), True)
        submission.put(Event(delta, len(ids), finish="length"))
        return "length"
