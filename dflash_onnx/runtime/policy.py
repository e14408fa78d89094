"""How much to speculate: each step's verify length from the draft's confidence and the backend's cost curve.

Verifying a whole block pays only where a block costs little more than one token. With `auto`, each step
verifies the k drafted tokens (0..B-1) that maximise the expected committed tokens per unit of time,
`(1 + E[accepted | confidences, k]) / (t(k + 1) + t_draft)`, and skips the draft call entirely while recent
steps say speculation would not beat greedy's `1 / t(1)`, drafting again now and then to notice when
acceptance rises. E[accepted] multiplies, position by position, the probability that the target agrees with
the proposal at that confidence; that probability is learnt online from the accept / reject outcomes the
loop sees (monotone in confidence), so a badly calibrated draft cannot mislead it for long; a decoder keeps it
across its requests, so each request does not pay to learn it again. A draft may give more than one confidence
per proposal (DSpark: its confidence head's prediction and the argmax probability of its logits): each gets its
own calibration, scored by the log-loss of its predictions on the outcomes as they come, and each step reads
the one that has predicted them best so far, so a head that ranks proposals worse cannot cost speed.

Where a step that verifies only its last token carries a lookup guess in its padding row (lookup.py), that
step commits 1 + P(guess right) tokens on average: the policy keeps the guesses' running hit rate and weighs
both the skipped draft and k = 0 at that rate, so DFlash stays at least as fast as the guessing greedy.

The curve prices graph calls measured alone, at the lowering's context, on the day it was measured. What a
step costs in this process is measured as it runs (Measured, kept across a decoder's requests): each target
call's time against the curve's (a busier machine, a stale curve), and what a step spends besides its target
call, with a draft call and without (the draft call itself, the loop's own work), which on a small model is a
large share of a step. The policy weighs those; and it compares what its drafted steps committed per millisecond
of wall time, all costs paid (a draft call ingesting the rows of a greedy stretch included), with what it
expected of them (scored as the decision to draft scores them, optimistically), and holds drafting to that
realized share: whatever the model of a step misses, drafting that does not beat the greedy steps beside it
stops. Probes wait twice as long after each that finds drafting still not paying (64 steps up to 1024).

Near a request's end (its token budget within one step's reach) a step is chosen to finish soonest instead: what
it leaves costs a later step whole.

Only the number of verified rows changes: greedy output stays the target's greedy output, and sampled
output stays exact (rejection sampling over the verified prefix). numpy only.
"""

from __future__ import annotations

import numpy as np

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import CostModel

BINS = 10
PRIOR = 2.0  # pseudo-tries per confidence bin, at the bin's own confidence: the draft is believed at first
HISTORY, RECENT = 32, 4  # drafted steps whose confidences are kept; the last few of them make "recent"
FADE = 0.8  # per step without a draft, how much of the recent average's difference from the long run remains
PROBE_MAX = 64  # steps without a draft before one is made anyway, to refresh the long-run average
PROBE_LIMIT = 1024  # the longest a probe waits, doubled from PROBE_MAX by probes after which drafting did not pay
GUESS_WEIGHT = 0.1  # how much each lookup guess's outcome moves the running hit rate (lookup.py)
TIME_WEIGHT = 0.1  # how much each measured step moves the running step times
LOSS_FADE = 0.99  # per judged proposal, how much of a signal's past log-loss still counts against it
SURE = 1e-3  # calibrated predictions are scored as if never beyond [SURE, 1 - SURE]


def isotonic(values: list[float], weights: list[float] | None = None) -> np.ndarray:
    """The non-decreasing sequence closest to `values` in weighted least squares (pool adjacent violators)."""
    merged: list[list[float]] = []  # [value, weight, entries merged]
    for value, weight in zip(values, weights or [1.0] * len(values)):
        merged.append([value, weight, 1])
        while len(merged) > 1 and merged[-2][0] > merged[-1][0]:
            value, weight, count = merged.pop()
            previous = merged[-1]
            total = previous[1] + weight
            merged[-1] = [(previous[0] * previous[1] + value * weight) / total, total, previous[2] + count]
    return np.repeat([m[0] for m in merged], [m[2] for m in merged])


def parse_verify(value: str | int) -> str | int:
    """`--verify`: auto, full, or how many drafted tokens to verify each step."""
    if value in ("auto", "full"):
        return value
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = -1
    if count < 0:
        raise DFlashError(f"--verify {value}: give auto, full or a count of drafted tokens (0 or more)")
    return count


class Calibration:
    """P(the target accepts a proposal | the draft's confidence in it), per confidence bin, monotone."""

    def __init__(self):
        centers = (np.arange(BINS) + 0.5) / BINS
        self.tries = np.full(BINS, PRIOR)
        self.accepts = PRIOR * centers
        self.table = self.optimistic = centers
        self.loss = 0.0  # the fading log-loss of its predictions, each scored before its outcome was learnt
        self._fit()

    def _fit(self) -> None:
        """Acceptance per bin, never falling as confidence rises (weighted by tries), and the same plus one
        standard error: bins seen little get the benefit of the doubt."""
        table = isotonic((self.accepts / self.tries).tolist(), self.tries.tolist())
        optimistic = np.minimum(1.0, table + np.sqrt(table * (1 - table) / self.tries))
        # one entry more: a confidence of exactly 1.0 falls in bin BINS, read as the top bin
        self.table, self.optimistic = np.append(table, table[-1]), np.append(optimistic, optimistic[-1])

    @staticmethod
    def bins(confidences: np.ndarray) -> np.ndarray:
        """Confidences in [0, 1] as bin indices 0..BINS (BINS only for 1.0; the tables repeat the top bin)."""
        return (np.asarray(confidences, np.float64) * BINS).astype(np.intp)

    def observe(self, bins: np.ndarray, accepted: int) -> None:
        """The first `accepted` proposals (by confidence bin) were accepted and, if one follows, it was rejected;
        later ones were never judged."""
        bins = np.minimum(bins[: accepted + 1], BINS - 1)
        predicted = np.clip(self.table[bins], SURE, 1.0 - SURE)
        predicted[accepted:] = 1.0 - predicted[accepted:]  # the rejected one, if any: scored on its rejection
        self.loss = self.loss * LOSS_FADE ** len(bins) - float(np.log(predicted).sum())
        self.tries += np.bincount(bins, minlength=BINS)
        self.accepts += np.bincount(bins[:accepted], minlength=BINS)
        self._fit()


class Measured:
    """What a decoder's steps have measured in this process, kept across its requests (dflash_onnx/runtime/decode.py),
    in
    running averages: the target call's time over the curve's for its rows; the milliseconds a step spends
    besides its target call, with a draft call (the draft call, the policy's and the loop's work) and without;
    what drafted steps committed per millisecond of wall time against what the policy expected of them; and the
    probes: steps since the last draft call, and how many a probe waits (doubled by each probe after which
    drafting still does not pay, reset by one after which it does)."""

    def __init__(self):
        self.scale = 1.0
        self.drafted_ms: float | None = None  # None until measured: the curve's draft step stands in
        self.plain_ms: float | None = None
        # drafted steps' committed tokens and wall milliseconds, measured and as the policy expected them
        self.tokens = self.wall_ms = self.expected_tokens = self.expected_ms = None
        self.since_draft, self.probe_wait = 0, PROBE_MAX

    @staticmethod
    def _moved(average: float | None, value: float) -> float:
        return value if average is None else average + TIME_WEIGHT * (value - average)

    def observe(self, drafted: bool, target_ms: float, curve_ms: float, other_ms: float) -> None:
        """A steady step's measured time: its target call (`curve_ms` by the curve) and the rest of the step (every
        step comes here: the arithmetic is written out)."""
        self.scale += TIME_WEIGHT * (target_ms / curve_ms - self.scale)
        if drafted:
            self.drafted_ms = self._moved(self.drafted_ms, other_ms)
        elif self.plain_ms is None:
            self.plain_ms = other_ms
        else:
            self.plain_ms += TIME_WEIGHT * (other_ms - self.plain_ms)

    def observe_drafted(self, tokens: int, wall_ms: float, expected_tokens: float, expected_ms: float) -> None:
        """A drafted step committed `tokens` in `wall_ms`; the policy expected `expected_tokens` in `expected_ms`."""
        self.tokens = self._moved(self.tokens, tokens)
        self.wall_ms = self._moved(self.wall_ms, wall_ms)
        self.expected_tokens = self._moved(self.expected_tokens, expected_tokens)
        self.expected_ms = self._moved(self.expected_ms, expected_ms)

    @property
    def realized(self) -> float:
        """Drafted steps' measured rate over the rate the policy expected of them (1 until measured)."""
        if self.tokens is None:
            return 1.0
        return (self.tokens / self.wall_ms) / (self.expected_tokens / self.expected_ms)

    def probed(self, paid: bool) -> None:
        """After a probe, drafting paid (the next step drafts too) or did not."""
        self.probe_wait = PROBE_MAX if paid else min(2 * self.probe_wait, PROBE_LIMIT)


class VerifyPolicy:
    """Per step: whether to call the draft, and how many of its tokens to verify. This base verifies every drafted
    token it may (`full`, the reference's behaviour) and learns nothing; FixedPolicy verifies a set count and
    AdaptivePolicy (`auto`) chooses by the draft's confidence and the cost curve. `verify_policy` picks one."""

    mode: str | int = "full"

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.guessing = False  # whether this step, drafting nothing, would verify a lookup guess (set by the loop)

    def reprice(self, costs: CostModel | None) -> None:
        """Weigh another cost curve from now on (a batched request's share changes as requests join and leave)."""

    def wants_draft(self, most: int) -> bool:
        """Call the draft this step? `most`: how many drafted tokens could still be kept."""
        return most >= 1

    def choose(self, confidences: np.ndarray | None, most: int) -> int:
        """How many of the drafted tokens to verify (0..most)."""
        return most

    def observe(self, verified: int, accepted: int) -> None:
        """The outcome of the step `choose` last chose for: `accepted` of its `verified` drafted tokens."""

    def observe_guess(self, right: bool) -> None:
        """A step without drafted tokens verified a lookup guess; `right`: the target agreed with it."""

    def observe_time(self, ingested: int, rows: int, target_ms: float, step_ms: float, committed: int) -> None:
        """A step's measured wall time (see AdaptivePolicy.observe_time)."""


class FixedPolicy(VerifyPolicy):
    """Verify `count` drafted tokens a step (fewer where fewer are left); 0 never calls the draft."""

    def __init__(self, count: int, block_size: int):
        super().__init__(block_size)
        self.mode = count

    def wants_draft(self, most: int) -> bool:
        return most >= 1 and self.mode > 0

    def choose(self, confidences: np.ndarray | None, most: int) -> int:
        return min(self.mode, most)


def verify_policy(mode: str | int, costs: CostModel | None, block_size: int,
                  calibrations: list[Calibration] | None = None, measured: Measured | None = None) -> VerifyPolicy:
    """The policy for `--verify` `mode` (auto, full or a count): `auto` without a cost curve to weigh verifies full
    blocks, as the reference does. `calibrations` and `measured`: what `auto` shares with earlier requests."""
    mode = parse_verify(mode)
    if mode == "auto" and costs is not None and len(costs.verify_ms) >= block_size:
        return AdaptivePolicy(costs, block_size, calibrations, measured)
    if mode in ("auto", "full"):
        return VerifyPolicy(block_size)
    return FixedPolicy(mode, block_size)


class AdaptivePolicy(VerifyPolicy):
    """`auto`: the verify length that commits the most tokens per millisecond, by the draft's calibrated confidence
    and the cost curve, the draft call skipped while drafting does not pay (the module's docstring)."""

    mode = "auto"

    def __init__(self, costs: CostModel, block_size: int, calibrations: list[Calibration] | None = None,
                 measured: Measured | None = None):
        """`calibrations`: what earlier requests of the same pair learnt, one per confidence signal (shared, and
        updated by this one; an empty list grows to the signals the draft gives). `measured`: what the steps
        have measured so far (shared likewise); None weighs the curve alone."""
        super().__init__(block_size)
        self.times = measured
        self.timed = 0
        self._probing = False  # the last draft call was a probe: the next decision says whether drafting paid
        self._expected: tuple[float, float] | None = None  # the last choice's expected tokens and milliseconds
        self.reprice(costs)
        self.calibrations = [] if calibrations is None else calibrations
        if not self.calibrations:
            self.calibrations.append(Calibration())
        self.signals = 1  # how many confidences per proposal the draft gives
        # confidence bins of the last HISTORY drafted steps, each signal's
        self.history = np.zeros((0, 1, block_size - 1), np.intp)
        self.recent = self.overall = 0.0  # their best expected rates, scored when the calibration last moved
        self.skipped, self.observed = 0, 0
        self._bins: np.ndarray | None = None  # the last choice's confidence bins, for its observation
        self.guess_hits = 0.0  # running share of right lookup guesses (0 while no step has guessed)

    def reprice(self, costs: CostModel) -> None:
        self.costs = costs
        self._price()
        if getattr(self, "history", None) is not None and len(self.history):
            self._rescore()

    def _price(self) -> None:
        """A drafted step verifying k = 0..B-1 drafted tokens: t(k + 1) + t_draft; a step without a draft: t(1);
        each as this process measures them where it has (Measured)."""
        costs, times = self.costs, self.times
        verify = np.asarray(costs.verify_ms[: self.block_size], np.float64)
        draft_ms, plain_ms = costs.draft_ms, 0.0
        if times is not None:
            verify = verify * times.scale
            draft_ms = costs.draft_ms * times.scale if times.drafted_ms is None else times.drafted_ms
            plain_ms = times.plain_ms or 0.0
        self.round_ms = verify + draft_ms
        self.greedy_rate = 1.0 / (verify[0] + plain_ms)

    def observe_time(self, ingested: int, rows: int, target_ms: float, step_ms: float, committed: int) -> None:
        """A step's measured wall time: its target call of `rows` rows and the whole step, which committed
        `committed` tokens; `ingested`: the context rows its draft call took (0: no draft call). A steady step (one
        whose draft call, if any, took at most a verify's rows) moves the costs weighed from now on; every drafted
        step is compared with what was expected of it."""
        if self.times is None:
            return
        if ingested and self._expected is not None:
            self.times.observe_drafted(committed, step_ms, *self._expected)
        self._expected = None
        if ingested > self.block_size:
            return
        curve = self.costs.verify_ms
        self.times.observe(ingested > 0, target_ms, curve[min(rows, len(curve)) - 1], max(0.0, step_ms - target_ms))
        self.timed += 1
        if self.timed % 4 == 1:  # the averages move slowly: repriced every few steps, a step's own work kept small
            self._price()
        if self.timed % 32 == 1 and len(self.history):  # what recent drafted steps would commit, at today's costs
            self._rescore()  # (every drafted step's observation rescores them too)

    @property
    def signal(self) -> int:
        """The signal whose calibrated predictions have had the lowest log-loss (the first one on a tie)."""
        losses = [calibration.loss for calibration in self.calibrations[: self.signals]]
        return int(np.argmin(losses))

    @property
    def calibration(self) -> Calibration:
        """The calibration of the signal read now."""
        return self.calibrations[self.signal]

    def _rescore(self) -> None:
        """The recent and overall expected rates of the drafted steps in the history, at the current costs."""
        best = self.rates(self.history[:, self.signal], self.calibration.optimistic).max(axis=-1)
        self.recent, self.overall = float(best[-RECENT:].mean()), float(best.mean())

    def _guess_gain(self) -> float:
        """Tokens a step without drafted tokens commits beyond its own: the guess's hit rate where it guesses."""
        return self.guess_hits if self.guessing else 0.0

    def observe_guess(self, right: bool) -> None:
        """A step without drafted tokens verified a lookup guess; `right`: the target agreed with it."""
        self.guess_hits += GUESS_WEIGHT * (float(right) - self.guess_hits)

    def rates(self, bins: np.ndarray, table: np.ndarray | None = None) -> np.ndarray:
        """Expected committed tokens per millisecond of drafted steps verifying k = 0..n of their proposals,
        per row of confidence bins [..., n]: (1 + E[accepted]) / (t(k + 1) + t_draft)."""
        accept = (self.calibration.table if table is None else table)[bins]
        expected = np.cumsum(np.cumprod(accept, axis=-1), axis=-1)
        n = bins.shape[-1]
        rates = np.empty((*bins.shape[:-1], n + 1))
        rates[..., 0] = (1.0 + self._guess_gain()) / self.round_ms[0]
        rates[..., 1:] = (1.0 + expected) / self.round_ms[1 : n + 1]
        return rates

    def wants_draft(self, most: int) -> bool:
        """Call the draft this step? `most`: how many drafted tokens could still be kept. Speculation is
        expected to pay what the recent drafted steps would (optimistically scored with what the calibration
        knows), fading towards what the longer history would with every step that does not draft: the text
        moves on, so a poor stretch ends (and so does a good one). Where steps are measured, that expectation is
        held to the share of their expected rate that drafted steps have delivered, a request's first step
        expects what drafted steps have delivered, and probes back off while they find drafting not paying."""
        if most < 1:
            return False
        times = self.times
        if len(self.history) == 0:
            if times is None or times.tokens is None:
                return True
            expected = times.tokens / times.wall_ms  # a request's first step: what drafted steps delivered
        else:
            expected = self.overall + (self.recent - self.overall) * FADE**self.skipped
            if times is not None:
                expected *= times.realized
        pays = expected >= self.greedy_rate * (1.0 + self._guess_gain())
        if self._probing:
            times.probed(pays)
            self._probing = False
        waited = times.since_draft if times is not None else self.skipped
        if pays or waited >= (times.probe_wait if times is not None else PROBE_MAX):
            self._probing = not pays and times is not None
            self.skipped = 0
            if times is not None:
                times.since_draft = 0
            return True
        self.skipped += 1
        if times is not None:
            times.since_draft += 1
        return False

    def choose(self, confidences: np.ndarray | None, most: int) -> int:
        """How many of the drafted tokens to verify (0..most). `confidences`: per proposal [P], or per signal and
        proposal [signals, P]; the one that has predicted acceptance best so far is read."""
        if confidences is None:
            return most
        self._bins = Calibration.bins(np.atleast_2d(confidences))
        if len(self._bins) != self.signals:  # another draft's signals: what the history kept no longer applies
            self.signals = len(self._bins)
            self.calibrations.extend(Calibration() for _ in range(self.signals - len(self.calibrations)))
            self.history = np.zeros((0, self.signals, self.history.shape[-1]), np.intp)
        bins = self._bins[self.signal, :most]
        rates = self.rates(bins)
        if most < self.block_size - 1:  # the request's last tokens are all within this step's reach
            chosen = self._finishing(rates, most + 1)
        else:
            chosen = int(np.argmax(rates))
        if self.times is not None:  # what the choice should deliver as wants_draft scores it (optimistically)
            hoped = self.rates(bins[:chosen], self.calibration.optimistic)[-1]
            self._expected = (float(hoped * self.round_ms[chosen]), float(self.round_ms[chosen]))
        return chosen

    def _finishing(self, rates: np.ndarray, remaining: int) -> int:
        """The verify length that ends a request's last `remaining` tokens soonest. The best rate per step is the
        wrong aim there: a step that stops short leaves tokens that a later step pays whole for (verifying 13 of 14
        sure proposals in 14 rows, and the last token in a greedy step, rather than 14 in a 16-row padded call).
        So: this step's time, plus what it is expected to leave at a greedy step's rate, the way a short remainder
        is finished."""
        rounds = self.round_ms[: len(rates)]
        left = np.maximum(0.0, remaining - rates * rounds)  # rates * rounds: the tokens each length commits
        return int(np.argmin(rounds + left / (self.greedy_rate * (1.0 + self._guess_gain()))))

    def observe(self, verified: int, accepted: int) -> None:
        """The outcome of the step `choose` last chose for: `accepted` of its `verified` drafted tokens (every
        signal's calibration learns it, and is scored on it)."""
        if self._bins is None:
            return
        if verified > 0:
            for calibration, bins in zip(self.calibrations, self._bins):
                calibration.observe(bins[:verified], accepted)
        if self._bins.shape[-1] == self.history.shape[-1]:  # steps near the end are shorter: kept out of the history
            self.history = np.concatenate([self.history[1 - HISTORY:], self._bins[None]])
        self.observed += 1
        if self.observed % 2 == 1 or len(self.history) < 2:  # rescored every other step: it drifts slowly
            self._rescore()
        self._bins = None


def simulate(mode: str | int, costs: CostModel, steps: list[tuple[np.ndarray, int]]) -> dict:
    """Replay recorded full-block steps (the draft's confidences [P] or [signals, P], how many proposals the target
    accepted) of one text under a cost curve: committed tokens per millisecond of `mode`, of greedy decoding and of full
    blocks. The text advances by what each step commits; a drafted step reads the recording that covers its
    position, from that position on (a run the recording accepted keeps to where it ended; its acceptance is
    capped at the tokens verified); a step without a draft commits one token at t(1)."""
    block = len(costs.verify_ms)
    verify, draft_ms = np.asarray(costs.verify_ms, np.float64), costs.draft_ms
    starts = np.cumsum([0] + [1 + accepted for _, accepted in steps])  # the text position each recording covers
    total = int(starts[-1])
    full_rate = total / (len(steps) * (verify[block - 1] + draft_ms))
    policy = verify_policy(mode, costs, block)
    position, spent, drafted = 0, 0.0, 0
    while position < total:
        if policy.wants_draft(block - 1):
            index = int(np.searchsorted(starts, position, side="right")) - 1
            recorded, accepted = steps[index]
            offset = position - int(starts[index])
            accepted = max(0, accepted - offset)
            confidences = np.concatenate([recorded[..., offset:], np.repeat(recorded[..., -1:], offset, axis=-1)],
                                         axis=-1)
            k = policy.choose(confidences, block - 1)
            accepted = min(accepted, k)
            policy.observe(k, accepted)
            position, spent, drafted = position + 1 + accepted, spent + verify[k] + draft_ms, drafted + 1
        else:
            position, spent = position + 1, spent + verify[0]
    return {"rate": position / spent, "greedy_rate": 1.0 / verify[0], "full_rate": full_rate,
            "drafted_steps": drafted}
