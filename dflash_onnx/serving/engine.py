"""The engine: it owns the decoder's sessions and runs the queued requests, one at a time or side by side.

The HTTP layer (app.py) and other hosts (Ray Serve, Triton's Python backend) call `Engine.submit`, never ORT: a
request waits in a bounded queue, then is decoded with DFlash (`--verify auto`: never slower than greedy), its
text deltas put on the request's own queue. A cancelled request (a client gone) stops at its next decoding step, or
during a long prefill at its next prefill chunk.
Without a batch the engine thread decodes the requests one after another; with one (`dflash_onnx.targets.open_batch` on
a
lowering with the ragged attention) up to its slots run at once on the engine thread, each a task of one
`StepLoop`, their target calls joined into one call per step, and their draft calls too where the lowering allows
it (greedy requests; a sampled request drafts on a session of its own) (dflash_onnx/runtime/batching.py); a request
joins or
leaves between steps.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from dflash_onnx.runtime.batching import BatchParts, StepBatcher, StepLoop
from dflash_onnx.runtime.decode import Decoder
from dflash_onnx.runtime.errors import Cancelled, DFlashError
from dflash_onnx.runtime.sampling import SamplingParams
from dflash_onnx.runtime.tokenizer import TextCodec


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
    generated so far, `steps` the decoding steps after the prefill's first token (tau: the tokens after the first
    over the steps)."""

    text: str
    completion_tokens: int
    finish: str | None = None
    error: str | None = None
    steps: int = 0

    @property
    def tau(self) -> float | None:
        """Tokens committed per decoding step after the first token; None before any step ran."""
        return (self.completion_tokens - 1) / self.steps if self.steps else None


class Submission:
    """One request's handle: iterate it for its events (the engine thread fills them), or `attach` an event loop
    and await them; `cancel` stops it at its next decoding step or prefill chunk (before its prefill if it has not
    started)."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.events: queue.Queue[Event] = queue.Queue()
        self.cancelled = threading.Event()
        self.outcome: str | None = None  # once its last event is put: its finish reason, or "error"
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async: asyncio.Queue[Event] | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def ended(self) -> bool:
        """Its last event is put (a server shutting down reads what is still under way)."""
        return self.outcome is not None

    def put(self, event: Event) -> None:
        """The engine thread's side: to the attached event loop's queue, else to the thread-safe one."""
        if event.finish is not None or event.error is not None:
            self.outcome = "error" if event.error is not None else event.finish
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
    """`submit(request) -> Submission`; the decoder's sessions are used by the engine's thread alone: it decodes
    one request at a time without a batch, else up to the batch's slots side by side, their target calls met in
    one batched call per step (dflash_onnx/runtime/batching.py)."""

    def __init__(self, decoder: Decoder, codec: TextCodec, max_queue: int = 16, verify: str | int = "auto",
                 batch: BatchParts | None = None, max_prompt_tokens: int | None = None):
        """`batch`: the decoder's sessions for requests side by side (`dflash_onnx.targets.open_batch`): they then run
        up to the store's slots at once; None: one at a time. `max_prompt_tokens`: longer prompts are refused
        (None: as long as the lowering holds)."""
        if max_queue < 1:
            raise DFlashError(f"--max-queue must be at least 1, got {max_queue}")
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise DFlashError(f"--max-prompt-tokens must be at least 1, got {max_prompt_tokens}")
        self.decoder, self.codec, self.verify = decoder, codec, verify
        self.max_prompt_tokens = max_prompt_tokens
        self.stop_token_ids = frozenset(decoder.stop_token_ids)
        self.batcher: StepBatcher | None = None
        self._batch = batch
        # how the batch drafts, for the server's first line: shared, or why each request drafts on its own
        self.drafting = "" if batch is None or decoder.draft is None else "one draft call a step" \
            if batch.drafts is not None else f"a draft call per request ({batch.unshared_because})"
        if batch is not None:
            self.batcher = StepBatcher(batch.store, big_rows=_step_rows(decoder), drafts=batch.drafts)
        self.max_batch = self.batcher.store.slots if self.batcher else 1
        self._queue: queue.Queue[Submission | None] = queue.Queue(maxsize=max_queue)
        self.finished: Counter[str] = Counter()  # requests ended, by finish reason ("error" for failures)
        self._counting = threading.Lock()
        self._stopping = threading.Event()
        # the engine's thread, taking requests from the queue (kept for the server's life: ORT's per-thread state
        # is made once per thread, a few ms on a small model)
        self._thread = threading.Thread(target=self._run if self.batcher is None else self._run_batch,
                                        name="dflash-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> Submission:
        """Queue `request`; raises QueueFull when --max-queue requests wait already. Arguments the decoder
        refuses (a prompt past the lowering's context or --max-prompt-tokens, ids outside the vocabulary) raise
        DFlashError here."""
        if self.max_prompt_tokens is not None and len(request.prompt_ids) > self.max_prompt_tokens:
            raise DFlashError(f"the prompt's {len(request.prompt_ids)} tokens exceed this server's limit of "
                              f"{self.max_prompt_tokens} (--max-prompt-tokens): send a shorter prompt")
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
        """Stop after the requests under way; requests still queued end as cancelled."""
        self._stopping.set()
        self._thread.join(timeout=60)

    @property
    def stopped(self) -> bool:
        """The engine's thread has ended (after `close`)."""
        return not self._thread.is_alive()

    def _next(self, timeout: float | None) -> Submission | None:
        """The next queued request (None: none within `timeout`, or none at once where None); cancelled once the
        engine is stopping, so that it ends without touching the sessions."""
        try:
            submission = self._queue.get(timeout=timeout) if timeout is not None else self._queue.get_nowait()
        except queue.Empty:
            return None
        if self._stopping.is_set():
            submission.cancel()
        return submission

    def _run(self) -> None:
        """One request at a time."""
        while not (self._stopping.is_set() and self._queue.empty()):
            submission = self._next(0.1)
            if submission is not None:
                self._finish(submission, self.decoder)

    def _run_batch(self) -> None:
        """Up to the batch's slots side by side: between steps, queued requests join while slots are free (a
        cancelled one ends at once); then every request whose step has run goes on to its next call."""
        tasks = StepLoop(self.batcher)
        while tasks.tasks or not (self._stopping.is_set() and self._queue.empty()):
            while self.batcher.active < self.max_batch:
                submission = self._next(None if tasks.tasks else 0.1)
                if submission is None:
                    break
                if submission.cancelled.is_set():
                    self._finish(submission, self.decoder)
                else:
                    tasks.start(lambda submission=submission: self._batched(submission))
            if tasks.tasks:
                tasks.turn()

    def _batched(self, submission: Submission) -> None:
        """One request on a slot of the batch: the unchanged decoding loop; its draft calls joined with the other
        greedy requests' where the batch shares a draft, else on a session of its own."""
        slot = self.batcher.open()
        try:
            try:
                draft = self._batch.draft_for(slot, submission.request.sampling.greedy)
                decoder = self.decoder.for_slot(slot, draft, self.batcher)
            except Exception as exc:  # the request fails, the engine's thread goes on
                self._failed(submission, exc)
                return
            self._finish(submission, decoder)
        finally:
            slot.release()

    def _finish(self, submission: Submission, decoder: Decoder) -> None:
        try:
            reason = self._decode(submission, decoder)
        except Exception as exc:  # one request's failure must not stop the engine for the others
            self._failed(submission, exc)
            return
        with self._counting:
            self.finished[reason] += 1

    def _failed(self, submission: Submission, exc: Exception) -> None:
        message = str(exc) if isinstance(exc, DFlashError) else f"{type(exc).__name__}: {exc}"
        submission.put(Event("", 0, error=message))
        with self._counting:
            self.finished["error"] += 1

    def _decode(self, submission: Submission, decoder: Decoder) -> str:
        """Run one request, putting its events; returns its finish reason."""
        request = submission.request
        if submission.cancelled.is_set():  # its client left while it waited: no prefill for nobody
            submission.put(Event("", 0, finish="cancelled"))
            return "cancelled"
        steps = decoder.stream(request.prompt_ids, request.max_tokens, "dflash", request.sampling, None, self.verify,
                               cancelled=submission.cancelled.is_set)
        ids: list[int] = []
        chunks = 0  # the prefill's first token, then one chunk a decoding step

        def event(text: str, finish: str | None = None) -> Event:
            return Event(text, len(ids), finish, steps=max(0, chunks - 1))

        shown = _StopText(request.stop)
        try:
            for chunk in steps:
                if submission.cancelled.is_set():
                    submission.put(event("", "cancelled"))
                    return "cancelled"
                ids.extend(chunk)
                chunks += 1
                ended = ids[-1] in self.stop_token_ids
                text = self.codec.decode(ids[:-1] if ended else ids)
                delta, stopped = shown.advance(text, ended or len(ids) >= request.max_tokens)
                if stopped or ended:
                    submission.put(event(delta))
                    submission.put(event("", "stop"))
                    return "stop"
                if delta or chunks == 1:  # the first token's event marks the time to first token, text or not
                    submission.put(event(delta))
        except Cancelled:  # between the chunks of a long prefill: the engine is free within one chunk's time
            submission.put(event("", "cancelled"))
            return "cancelled"
        finally:
            steps.close()
        delta, _ = shown.advance(self.codec.decode(ids), True)
        submission.put(event(delta, "length"))
        return "length"


def _step_rows(decoder: Decoder) -> int:
    """The most rows a decode or verify step calls the target with (a longer call is a prefill chunk)."""
    multiple = decoder.row_multiple
    return max(2, -(-decoder.manifest.verify_rows // multiple) * multiple)
