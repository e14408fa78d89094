"""Requests decoded side by side: each runs the unchanged decoding loop as a task of one `StepLoop`, and their
target calls meet here, one batched call per step (numpy and greenlet only).

The tasks share one thread: each is a greenlet (a suspendable call stack), so a request's loop, deep inside its
session call, gives way to the next request's at the step's barrier without a thread switch. With a thread per
request, each step paid every thread's wake-up and the interpreter lock passing between them, a large share of a
demo-pair step: the barrier's own work was about 210 us a step for 4 requests and 380 us for 8, against 107 and
180 us as tasks (benchmarks/step_loop.py, docs/serving.md).

Each request gets a `SlotSession`, a Session whose K/V live in one slot (batch row) of a shared `SlotStore` (the
ORT ragged-attention target: targets/ort/batch_session.py). A slot's `run` waits until every active request has a
call waiting (the step's barrier); the loop then runs them all: the calls of up to `big_rows` rows (decode
and verify steps) as one call over the active slots, each padded to the longest (its last id and position
repeated, as runners.py pads; padding rows write K/V past the request's length, which its next call overwrites),
and each longer call (a joining request's prefill chunk) alone on its slot, so a prefill neither pads the others'
steps nor waits for them. A prefilling slot rides in the batched call with a placeholder row written where its
own call writes next. Active requests fill slots 0..n-1, so a batched call binds one contiguous range: a request
that leaves hands its slot to the last one (its K/V moved, once).

Drafts meet here too, where the store has a DraftStore (the ragged ORT lowering on the CPU): a greedy request's
draft session is a `SlotDraftSession`, whose calls wait, like target calls, until every active request has a call
waiting; the requests that draft this step then run as one draft call (each with its own context rows, the
others' masked), before the step's target call. A request that drafts on a session of its own (a sampled one:
its draws stay those it makes alone) is waited for as it reaches its target call.

A request's tokens do not depend on its neighbours: each batch row attends only to its own slot, and the
lowering's row multiple keeps every matmul row's result independent of the call's row count (tested: each
request's tokens equal the same request decoded alone). A batched draft's proposals may differ from its
proposals alone in the last bits; the target verifies every proposal, so greedy tokens do not change.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import greenlet
import numpy as np

from dflash_onnx.runtime import recurrent
from dflash_onnx.runtime.errors import DFlashError

ROW_INPUTS = ("input_ids", "position_ids")


class SlotStore(Protocol):
    """A target session holding K/V for `slots` requests, one per batch row."""

    input_names: list[str]
    output_names: list[str]
    slots: int
    active: int  # slots 0..active-1 hold requests now (set by the batcher)

    def run_slots(self, first: int, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        """One call over slots first..first + batch - 1 (feeds [batch, rows]); outputs [batch, rows, ...]."""
        ...

    def move_slot(self, source: int, dest: int) -> None:
        """Copy slot `source`'s K/V into slot `dest`."""
        ...


class DraftStore(Protocol):
    """A draft session holding context rows for `slots` requests, one per batch row."""

    input_names: list[str]
    output_names: list[str]
    slots: int

    def run_slots(self, calls: dict[int, tuple[dict[str, np.ndarray], list[str]]],
                  active: int) -> dict[int, dict[str, np.ndarray]]:
        """One call for these slots' draft calls (each as a rows-form draft session takes it); `active`: the slots
        0..active-1 in use. Each slot's outputs [1, ...]."""
        ...

    def move_slot(self, source: int, dest: int) -> None:
        """Copy slot `source`'s context rows into slot `dest`."""
        ...


@dataclass
class BatchParts:
    """What decodes requests side by side on one directory (targets.open_batch): the target's SlotStore, the
    draft's DraftStore (None: each request drafts on a session of its own), and a function giving a request its
    own draft session (None without a draft)."""

    store: SlotStore
    drafts: DraftStore | None
    own_draft: Callable[[], object | None]
    unshared_because: str | None = None  # why `drafts` is None where the directory has a draft

    def draft_for(self, slot: SlotSession, greedy: bool) -> object | None:
        """A request's draft session: its share of the step's draft call where the batch shares one and the request
        is greedy, else a session of its own (a sampled request's draws then stay those it makes alone)."""
        return slot.draft_session() if greedy and self.drafts is not None else self.own_draft()


@dataclass
class _Call:
    feeds: dict[str, np.ndarray]
    names: list[str]
    outputs: dict[str, np.ndarray] | None = None
    error: Exception | None = None
    done: bool = False  # it has its outputs or its error: its task goes on at the loop's next turn

    @property
    def rows(self) -> int:
        return int(self.feeds["input_ids"].shape[1])

    @property
    def start(self) -> int:
        """Where the call's rows are written: its length after the call minus its rows."""
        return int(self.feeds["seqlens_k"][0]) + 1 - self.rows


@dataclass
class _Step:
    """A batched step as the switch measures it: from the end of the batched call before it (`since`; None: none
    right before) to the end of its own calls, in the mode its requests read, with where each request's rows
    started; `clean`: no lone prefill call ran in it."""

    since: float | None
    ended: float
    drafting: bool
    starts: dict[SlotSession, int]
    clean: bool


@dataclass
class BatchStats:
    """What the batcher ran: batched calls and the requests in them, lone (prefill) calls, padding rows."""

    batched_calls: int = 0
    batched_requests: int = 0
    draft_calls: int = 0  # draft calls made for several requests' drafts (DraftStore)
    drafted_requests: int = 0  # the requests' draft calls they held
    lone_calls: int = 0
    padding_rows: int = 0
    widest: int = 0
    by_width: dict[int, int] = field(default_factory=dict)


class SpeculationSwitch:
    """Whether the batch's requests draft, per batch width, from the tokens per second the batch's own steps
    commit in each mode. A request's verify policy weighs its share of the target's cost curve, but a batched step
    also waits for every request's draft and per-step work, which the curve does not hold (on the demo pair at 8
    requests, drafting steps committed less than greedy ones). Each mode's rate is measured on its own steps: the
    mode not in use is tried for PROBE_STEPS steps, first after FIRST_PROBE steps at a width, then PROBE_EVERY
    steps later; each probe that loses doubles the width's wait for the next (up to PROBE_MOST steps), one that
    wins brings it back to PROBE_EVERY, so a mode that keeps losing costs few steps. Requests joining and leaving
    keep changing the width, and the demo pair's drafting steps of 8 requests committed at 0.45x greedy steps' rate,
    so a width not yet compared runs as the compared ones imply (drafting loses wider than where it lost, wins
    narrower than where it won), skipping its first probe where they do, else as the nearest compared width chose.
    Tokens do not depend on it: drafted tokens are verified, greedy steps are greedy."""

    FIRST_PROBE, PROBE_EVERY, PROBE_STEPS, PROBE_MOST = 8, 64, 4, 1024
    RECENT = 16  # steps per width and mode whose tokens over their time are the mode's rate

    def __init__(self):
        # (width, drafting) -> the tokens its most recent steps committed over their time. Not a running mean of
        # step rates: one step slowed by something neither mode causes (a thread descheduled) moves that for many
        # steps. Not a median either: a drafting mode's rare costly steps (a draft call taking in a long backlog, a
        # long verify all rejected) are its own cost, and a median leaves them out (docs/serving.md)
        self._recent: dict[tuple[int, bool], collections.deque[tuple[float, float]]] = {}
        self.rates: dict[tuple[int, bool], float] = {}
        self.drafting = True
        self._steps: dict[int, int] = {}  # steps measured at each width
        self._probe = 0  # steps of the probed mode still to run
        self._probed_from = True  # the mode a probe left
        self._wait: dict[int, int] = {}  # steps from one probe at a width to its next
        self._next: dict[int, int] = {}  # the step count at which a width probes next

    def _verdicts(self) -> dict[int, bool]:
        """Whether drafting committed faster, at each width where both modes have been measured."""
        return {w: rate >= self.rates[(w, False)] for (w, mode), rate in self.rates.items()
                if mode and (w, False) in self.rates}

    def _implied(self, width: int, verdicts: dict[int, bool]) -> bool | None:
        """Drafting's verdict at a width not yet compared, from those that are: drafting gains less the wider the
        batch (each request's share of a verify grows, a greedy step's shrinks), so it loses where it lost at a
        narrower width and wins where it won at a wider one; None where neither holds."""
        if any(not won for w, won in verdicts.items() if w <= width):
            return False
        if any(won for w, won in verdicts.items() if w >= width):
            return True
        return None

    def _faster(self, width: int) -> bool:
        """Whether drafting commits faster at `width`: as measured there once both modes have been, else as the
        compared widths imply, else as at the nearest compared width, else drafting."""
        verdicts = self._verdicts()
        if width in verdicts:
            return verdicts[width]
        implied = self._implied(width, verdicts)
        if implied is not None or not verdicts:
            return implied is not False
        return verdicts[min(verdicts, key=lambda w: (abs(w - width), -w))]

    def observe(self, width: int, drafting: bool, tokens: int, seconds: float) -> None:
        """A step of `width` requests in mode `drafting` committed `tokens` in `seconds`; then choose the mode of
        the next step at that width."""
        if seconds <= 0:
            return
        key = (width, drafting)
        recent = self._recent.setdefault(key, collections.deque(maxlen=self.RECENT))
        recent.append((tokens, seconds))
        self.rates[key] = sum(t for t, _ in recent) / sum(seconds for _, seconds in recent)
        steps = self._steps[width] = self._steps.get(width, 0) + 1
        if self._probe:
            self._probe -= 1
            if self._probe:
                return
            self.drafting = self._faster(width)
            wait = self._wait.get(width, self.PROBE_EVERY)
            lost = self.drafting == self._probed_from
            self._wait[width] = min(2 * wait, self.PROBE_MOST) if lost else self.PROBE_EVERY
            self._next[width] = steps + self._wait[width]
            return
        first = steps == self.FIRST_PROBE and self._implied(width, self._verdicts()) is None
        if first or steps >= self._next.get(width, self.PROBE_EVERY):
            self._probed_from, self._next[width] = drafting, steps + self._wait.get(width, self.PROBE_EVERY)
            self.drafting, self._probe = not drafting, self.PROBE_STEPS
            self._recent.pop((width, not drafting), None)  # the probe measures that mode as it is now
            return
        self.drafting = self._faster(width)


class SlotSession:
    """One request's view of the store: a Session (retains_state) whose calls go through the batcher."""

    retains_state = True

    def __init__(self, batcher: StepBatcher, slot: int):
        self.batcher, self.slot = batcher, slot
        self.input_names, self.output_names = batcher.store.input_names, batcher.store.output_names

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        return self.batcher.call(self, feeds, list(output_names or self.output_names))

    def release(self) -> None:
        """The request is over: its slot goes to another."""
        self.batcher.release(self)

    def draft_session(self) -> SlotDraftSession:
        """This request's draft calls, joined into one call a step with the other requests' (needs a DraftStore)."""
        if self.batcher.drafts is None:
            raise DFlashError("this batch has no shared draft: give each request a draft session of its own")
        return SlotDraftSession(self)


class SlotDraftSession:
    """One request's draft through the batcher: a rows-form draft Session (retains_state) whose context rows live
    in its slot of the DraftStore."""

    retains_state = True

    def __init__(self, slot: SlotSession):
        self.slot = slot
        drafts = slot.batcher.drafts
        self.input_names, self.output_names = drafts.input_names, drafts.output_names

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        return self.slot.batcher.draft_call(self.slot, feeds, list(output_names or self.output_names))


class StepBatcher:
    """The step barrier over a SlotStore (see the module docstring)."""

    def __init__(self, store: SlotStore, big_rows: int, drafts: DraftStore | None = None):
        self.store, self.big_rows, self.drafts = store, big_rows, drafts
        self._active: list[SlotSession] = []  # index = slot
        self._pending: dict[int, _Call] = {}  # target calls waiting, by slot
        self._drafting: dict[int, _Call] = {}  # draft calls waiting, by slot
        self.stats = BatchStats()
        self.switch = SpeculationSwitch()
        # the last batched step, measured once the next call shows what it committed
        self._last: _Step | None = None

    @property
    def active(self) -> int:
        """Requests holding a slot now (read without the lock: each step reads it, and a stale count only prices
        one step on the neighbouring width)."""
        return len(self._active)

    def open(self) -> SlotSession:
        """A slot for a new request; DFlashError when every slot is taken."""
        if len(self._active) >= self.store.slots:
            raise DFlashError(f"all {self.store.slots} batch slots are taken")
        session = SlotSession(self, len(self._active))
        self._active.append(session)
        self.store.active = len(self._active)
        return session

    def release(self, session: SlotSession) -> None:
        if session not in self._active:
            return
        slot, last = session.slot, len(self._active) - 1
        if slot in self._pending or slot in self._drafting:  # a request leaves between steps only
            raise DFlashError(f"slot {slot} released with a call waiting")
        if slot != last:  # the last request moves into the freed slot, its waiting call with it
            moved = self._active[last]
            self.store.move_slot(last, slot)
            if self.drafts is not None:
                self.drafts.move_slot(last, slot)
            moved.slot = slot
            for waiting in (self._pending, self._drafting):
                if last in waiting:
                    waiting[slot] = waiting.pop(last)
            self._active[slot] = moved
        self._active.pop()
        self.store.active = len(self._active)

    def call(self, session: SlotSession, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        """A target call: it runs when every active request has a call waiting (see the module docstring)."""
        return self._wait(self._pending, session, _Call(feeds, names))

    def draft_call(self, session: SlotSession, feeds: dict[str, np.ndarray],
                   names: list[str]) -> dict[str, np.ndarray]:
        """A draft call: it runs with the step's other draft calls, before the step's target call."""
        return self._wait(self._drafting, session, _Call(feeds, names))

    def _wait(self, waiting: dict[int, _Call], session: SlotSession, call: _Call) -> dict[str, np.ndarray]:
        """Register the call and give way to the loop, which runs the step once every request's call waits (a
        caller outside a StepLoop, one request alone, runs it at once)."""
        waiting[session.slot] = call
        task = greenlet.getcurrent()
        if isinstance(task, _Task):
            task.waiting = call
            while not call.done:
                task.parent.switch()
            task.waiting = None
        elif not self.run_step():
            waiting.pop(session.slot)
            raise DFlashError("a batched call waits for the other requests' calls: run each request as a StepLoop "
                              "task")
        if call.error is not None:
            raise call.error
        return call.outputs

    def run_step(self) -> bool:
        """When every active request has a call waiting, run the draft calls if there are any (their requests then
        make their target calls), else the target calls, and say so; their tasks go on at the loop's next turn."""
        if not (self._pending or self._drafting) or len(self._pending) + len(self._drafting) < len(self._active):
            return False
        if self._drafting:
            calls, self._drafting = self._drafting, {}
            run = self._run_drafts
        else:
            calls, self._pending = self._pending, {}
            run = self._run
        try:
            run(calls)
        except Exception as exc:  # every waiting request fails with the step, none hangs
            for call in calls.values():
                if call.outputs is None:
                    call.error = exc
        for call in calls.values():
            call.done = True
        return True

    def _run_drafts(self, calls: dict[int, _Call]) -> None:
        outputs = self.drafts.run_slots({slot: (call.feeds, call.names) for slot, call in calls.items()},
                                        len(self._active))
        for slot, call in calls.items():
            call.outputs = outputs[slot]
        self.stats.draft_calls += 1
        self.stats.drafted_requests += len(calls)

    @property
    def drafting(self) -> bool:
        """Whether the batch's requests draft this step (SpeculationSwitch)."""
        return self.switch.drafting

    def _measure(self, starts: dict[SlotSession, int]) -> None:
        """The last batched step to the switch: the tokens its requests committed (`starts`, where this step's
        rows start, less where its rows started) over the time from the end of the batched call before it to the
        end of its own, which holds its draft call and the requests' work between the calls. Requests that joined
        since are left out; under load requests come and go at most steps, so a step is measured on those that
        stayed. A step with a lone prefill call, or without a batched call right before it, is not measured."""
        last = self._last
        if last is None or last.since is None or not last.clean:
            return
        stayed = [session for session in last.starts if session in starts]
        if not stayed:
            return
        tokens = sum(starts[session] - last.starts[session] for session in stayed)
        self.switch.observe(len(last.starts), last.drafting, tokens * len(last.starts) / len(stayed),
                            last.ended - last.since)

    def _run(self, pending: dict[int, _Call]) -> None:
        small = {slot: call for slot, call in pending.items() if call.rows <= self.big_rows}
        drafting = self.switch.drafting  # the mode this step's requests read as they began it
        starts = {self._active[slot]: call.start for slot, call in small.items()}
        if small:
            self._measure(starts)
            self._run_batched(pending, small)
        for slot, call in pending.items():
            if slot not in small:
                call.outputs = self.store.run_slots(slot, call.feeds, call.names)
                self.stats.lone_calls += 1
        since = self._last.ended if self._last is not None else None
        self._last = _Step(since, time.perf_counter(), drafting, starts, len(small) == len(pending)) if small \
            else None

    def _run_batched(self, pending: dict[int, _Call], small: dict[int, _Call]) -> None:
        """One call over slots 0..n-1: each small call padded to the longest; a slot whose call is long (a
        prefill chunk, run next) gets placeholder rows at its call's start, which that call overwrites."""
        count, rows = len(pending), max(call.rows for call in small.values())
        names = sorted({name for call in small.values() for name in call.names})
        ids = np.zeros((count, rows), np.int64)
        positions = np.zeros((count, rows), np.int64)
        lengths = np.zeros(count, np.int32)
        for slot, call in pending.items():
            start = call.start
            lengths[slot] = start + rows - 1
            if slot not in small:  # placeholder rows where its own call writes next
                positions[slot] = np.arange(start, start + rows)
                continue
            real = call.rows
            ids[slot, :real], positions[slot, :real] = call.feeds["input_ids"][0], call.feeds["position_ids"][0]
            ids[slot, real:], positions[slot, real:] = ids[slot, real - 1], positions[slot, real - 1]
            self.stats.padding_rows += rows - real
        feeds = {"input_ids": ids, "position_ids": positions, "seqlens_k": lengths,
                 "total_sequence_length": np.array(lengths.max() + 1, np.int32)}
        state = sorted({name for call in small.values() for name in call.feeds if recurrent.is_state_name(name)})
        if state:  # a hybrid target's linear-attention state, per request (recurrent.py)
            feeds.update(recurrent.join_feeds([small[slot].feeds if slot in small else None for slot in range(count)],
                                              state))
        outputs = self.store.run_slots(0, feeds, names)
        for slot, call in small.items():  # the K/V outputs stay in the store
            own = [name for name in call.names if name in outputs]
            call.outputs = {name: outputs[name][slot : slot + 1, : call.rows] for name in own
                            if not recurrent.is_state_name(name)}
            call.outputs.update(recurrent.slot_outputs({name: outputs[name] for name in own
                                                        if recurrent.is_state_name(name)}, slot, call.rows, rows))
        self.stats.batched_calls += 1
        self.stats.batched_requests += len(small)
        self.stats.widest = max(self.stats.widest, len(small))
        self.stats.by_width[len(small)] = self.stats.by_width.get(len(small), 0) + 1


class _Task(greenlet.greenlet):
    """A request's loop as a StepLoop task; `waiting`: the batched call it waits on (None: ready to go on)."""

    waiting: _Call | None = None


class StepLoop:
    """Requests' decoding loops side by side on one thread: each a task (a greenlet) that runs until its session
    call waits at the batcher's barrier. A turn resumes every task whose call has run, each until its next call
    waits or it ends, then runs the step once every request's call waits; tasks started between turns join the
    next step. Every call into the loop comes from the thread that made it."""

    def __init__(self, batcher: StepBatcher):
        self.batcher = batcher
        self.tasks: list[_Task] = []
        self._hub = greenlet.getcurrent()

    def start(self, work: Callable[[], None]) -> None:
        """Run `work` (a request's whole decoding, catching its own errors) as a task, now, until its first call
        waits or it ends."""
        if greenlet.getcurrent() is not self._hub:
            raise DFlashError("StepLoop.start is called from the loop's own thread, between turns")
        task = _Task(work, parent=self._hub)
        self.tasks.append(task)
        task.switch()
        self._prune()

    def turn(self) -> None:
        """Resume the tasks whose calls have run, then run the step if it is complete."""
        for task in [task for task in self.tasks if task.waiting is None or task.waiting.done]:
            task.switch()
        self._prune()
        if not self.batcher.run_step() and self.tasks and \
                not any(task.waiting is None or task.waiting.done for task in self.tasks):
            raise DFlashError(f"{len(self.tasks)} batched requests each wait on a call that no step will run")

    def _prune(self) -> None:
        self.tasks = [task for task in self.tasks if not task.dead]

    def run(self, works: list[Callable[[], None]], slots: int) -> None:
        """Every work as a task, at most `slots` at once, each started as soon as one ends (as the engine admits
        queued requests)."""
        waiting = list(works)
        while waiting or self.tasks:
            while waiting and len(self.tasks) < slots:
                self.start(waiting.pop(0))
            if self.tasks:
                self.turn()
