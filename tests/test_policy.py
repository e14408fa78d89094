"""The verify policy: its confidence calibration, its choices on known curves, and the replayed demo.

The simulation replays steps recorded on the demo pair (tests/data/demo_trace.json, written by
benchmarks/record_trace.py: per full-block step, the draft's confidence in each proposal and how many the target
accepted) under cost curves of three kinds of hardware."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import benchmark_script

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import CostModel
from dflash_onnx.runtime.policy import (
    BINS,
    PROBE_MAX,
    AdaptivePolicy,
    Calibration,
    FixedPolicy,
    Measured,
    VerifyPolicy,
    isotonic,
    parse_verify,
    simulate,
    verify_policy,
)

REPLAY = benchmark_script("policy_replay")  # the recording and the curves docs/verify-policy.md's table replays
TRACE = json.loads(REPLAY.TRACE.read_text())
STEPS = REPLAY.recorded_steps(TRACE)
B = TRACE["block_size"]
CURVES = REPLAY.curves(B)  # t(T) for T = 1..B and the draft step, relative to one decode step
M2, CPU = "M2-like (T=16 at 7.5x, draft 1.0x)", "CPU-like (T=16 at 3.25x, draft 1.6x)"


def test_isotonic_pools_violators_and_keeps_order():
    np.testing.assert_allclose(isotonic([1.0, 3.0, 2.0, 4.0]), [1.0, 2.5, 2.5, 4.0])
    np.testing.assert_allclose(isotonic([3.0, 1.0], [1.0, 3.0]), [1.5, 1.5])
    assert list(isotonic([0.1, 0.2, 0.3])) == [0.1, 0.2, 0.3]


def test_calibration_starts_at_the_confidence_and_learns_a_liar():
    calibration = Calibration()
    np.testing.assert_allclose(calibration.table[:BINS], (np.arange(BINS) + 0.5) / BINS)
    bins = Calibration.bins(np.full(15, 0.97))
    for _ in range(40):  # a draft sure of every token, right about the first only half of the time
        calibration.observe(bins, accepted=int(np.random.default_rng(len(bins)).random() < 0.5))
    assert calibration.table[9] < 0.6
    assert np.all(np.diff(calibration.table) >= 0)  # never less likely to be accepted when more confident
    assert np.all(calibration.optimistic >= calibration.table)


def test_a_confidence_of_one_reads_the_top_bin():
    calibration = Calibration()
    assert Calibration.bins(np.array([1.0]))[0] == BINS and calibration.table[BINS] == calibration.table[BINS - 1]


@pytest.mark.parametrize("value, parsed", [("auto", "auto"), ("full", "full"), ("3", 3), (0, 0)])
def test_verify_values(value, parsed):
    assert parse_verify(value) == parsed


@pytest.mark.parametrize("value", ["-1", "most", "2.5"])
def test_bad_verify_values(value):
    with pytest.raises(DFlashError, match="--verify"):
        parse_verify(value)


def test_without_a_cost_curve_auto_verifies_full_blocks():
    policy = verify_policy("auto", None, 8)
    assert type(policy) is VerifyPolicy and policy.mode == "full"
    assert policy.wants_draft(7) and policy.choose(np.full(7, 0.1), 7) == 7


def test_each_verify_mode_is_its_own_policy():
    """One class per mode: auto with a curve adapts; a count verifies that many (0: never drafts); full drafts
    whenever a token could be kept, and none of the fixed ones learns from outcomes."""
    costs = CostModel(verify_ms=[1.0] * 8, draft_ms=0.5)
    assert isinstance(verify_policy("auto", costs, 8), AdaptivePolicy)
    assert isinstance(verify_policy("auto", CostModel(verify_ms=[1.0] * 4, draft_ms=0.5), 8), VerifyPolicy)
    fixed, never, full = verify_policy("3", costs, 8), verify_policy(0, costs, 8), verify_policy("full", costs, 8)
    assert isinstance(fixed, FixedPolicy) and fixed.choose(np.full(7, 0.9), 2) == 2 and fixed.wants_draft(1)
    assert not never.wants_draft(7) and full.wants_draft(1) and not full.wants_draft(0)
    for policy in (fixed, full):
        policy.observe(3, 0)
        assert policy.choose(np.zeros(7), 7) == min(policy.choose(None, 7), 7)


def test_a_free_verify_takes_everything_and_a_costly_one_what_the_confidence_earns():
    confident = np.array([0.95] * 4 + [0.35] * 11)
    flat = verify_policy("auto", CostModel([1.0] * B, 0.2), B)
    assert flat.choose(confident, B - 1) == B - 1  # more rows cost nothing: verify them all
    steep = verify_policy("auto", CURVES[M2], B)
    assert 1 <= steep.choose(confident, B - 1) <= 5  # pay only for the tokens likely to be accepted
    assert steep.choose(confident, 2) <= 2  # never more than can be kept


def test_hopeless_drafting_stops_and_is_retried_now_and_then():
    policy = verify_policy("auto", CURVES[M2], B)
    decisions = []
    for _ in range(200):
        drafting = policy.wants_draft(B - 1)
        decisions.append(drafting)
        if drafting:
            policy.observe(policy.choose(np.full(B - 1, 0.95), B - 1), 0)  # the draft is never right
    assert sum(decisions) < 20 and any(decisions[100:])


@pytest.mark.parametrize("curve", CURVES)
def test_replayed_demo_never_loses_more_than_3_percent_to_the_better_fixed_choice(curve):
    result = simulate("auto", CURVES[curve], STEPS)
    best = max(result["greedy_rate"], result["full_rate"])
    assert result["rate"] >= 0.97 * best, result


def test_where_full_blocks_lose_to_greedy_auto_does_not():
    result = simulate("auto", CURVES[M2], STEPS)
    assert result["full_rate"] < 0.85 * result["greedy_rate"]  # full blocks lose here
    assert result["rate"] >= result["greedy_rate"]


def test_the_simulation_reproduces_the_fixed_policies():
    costs = CURVES[CPU]
    full = simulate("full", costs, STEPS)
    assert full["rate"] == pytest.approx(full["full_rate"])
    assert simulate(0, costs, STEPS)["rate"] == pytest.approx(full["greedy_rate"])


def test_a_fixed_verify_count_holds_without_confidences():
    """A sampled DSpark step passes no confidences (they follow the draws): --verify N still verifies N."""
    costs = CostModel(verify_ms=[1.0] * 8, draft_ms=0.5)
    assert verify_policy(3, costs, 8).choose(None, 7) == 3
    assert verify_policy("full", costs, 8).choose(None, 7) == 7
    assert verify_policy("auto", costs, 8).choose(None, 7) == 7


def test_right_lookup_guesses_raise_the_bar_that_drafting_must_clear():
    """A draft that commits 2 tokens a round on a curve where that beats 1 / t(1) keeps drafting, until the padding
    row's lookup guess is right often enough that a step without the draft commits as many for less."""
    costs = CostModel([1.0] * 4, 0.5)  # a drafted round: 1.5 ms
    policy = verify_policy("auto", costs, 4)
    for _ in range(8):
        assert policy.wants_draft(3)
        policy.observe(policy.choose(np.full(3, 0.5), 3), 1)  # each round commits 2 tokens: 1.33 per ms
    assert policy.wants_draft(3)  # against greedy's 1 per ms
    for _ in range(40):
        policy.observe_guess(True)  # a step without the draft commits 2 tokens per ms
    assert policy.guess_hits > 0.95
    assert policy.wants_draft(3)  # ... where it has a guess to carry: this step has none
    policy.guessing = True
    assert not policy.wants_draft(3)
    # k = 0 after a draft call: the guess rides in the padding row too, the round still pays the draft
    assert policy.rates(np.zeros((1, 3), np.intp))[0, 0] == pytest.approx((1.0 + policy.guess_hits) / 1.5)
    for _ in range(40):
        policy.observe_guess(False)
    assert policy.guess_hits < 0.05


def test_the_replay_takes_a_measured_curve(tmp_path, capsys):
    """`policy_replay --cost-model NAME=FILE` replays a measured curve (relative to its one-token step) beside the
    three kinds: a flat measured curve gives the flat kind's full-block speedup."""
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"verify_ms": [2.0] * B, "draft_ms": 0.6}))
    REPLAY.main(["--cost-model", f"measured flat={curve}"])
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "x |" in line}
    assert rows["measured flat"] == rows["flat (AI 100-like)"]


def test_what_one_request_learnt_spares_the_next_its_lossy_first_drafts():
    """A draft that is always confident and never right, on a curve where drafting pays only near-certain tokens:
    a fresh policy drafts a few steps before it learns; one given the calibration an earlier request learnt (as a
    decoder keeps it) skips the draft from the start."""

    def drafted_steps(calibrations: list[Calibration] | None) -> int:
        policy = verify_policy("auto", CURVES[M2], B, calibrations)
        drafted = 0
        for _ in range(32):
            if policy.wants_draft(B - 1):
                drafted += 1
                policy.observe(policy.choose(np.full(B - 1, 0.99), B - 1), 0)
        return drafted

    shared = Calibration()
    first = verify_policy("auto", CURVES[M2], B, [shared])
    for _ in range(32):
        if first.wants_draft(B - 1):
            first.observe(first.choose(np.full(B - 1, 0.99), B - 1), 0)
    assert shared.tries.sum() > BINS * 2  # the first request's outcomes went into the shared calibration
    assert drafted_steps(None) >= 3 and drafted_steps([shared]) <= 1


def test_of_two_signals_the_policy_reads_the_one_that_predicts_acceptance():
    """A draft giving two confidences per proposal, one telling which proposals the target accepts and one noise
    (a poorly trained confidence head): each signal's calibration is scored on the outcomes, and within a few
    steps the policy reads the telling one, verifying what it earns, as a policy given only that signal does."""
    rng = np.random.default_rng(0)
    telling, both = verify_policy("auto", CURVES[M2], B), verify_policy("auto", CURVES[M2], B, [])
    committed = {"telling": 0, "both": 0}
    for _ in range(200):
        accepted = int(rng.integers(0, B - 1))
        told = np.where(np.arange(B - 1) < accepted, 0.97, 0.03)
        noise = rng.random(B - 1)
        for name, policy, signals in (("telling", telling, told), ("both", both, np.stack([noise, told]))):
            if policy.wants_draft(B - 1):
                chosen = policy.choose(signals, B - 1)
                policy.observe(chosen, min(accepted, chosen))
                committed[name] += 1 + min(accepted, chosen)
    assert both.signal == 1 and both.calibrations[1].loss < both.calibrations[0].loss
    assert len(both.calibrations) == 2  # the shared list grew to the draft's signals
    assert committed["both"] >= 0.95 * committed["telling"]


@pytest.mark.parametrize("curve", CURVES)
def test_on_a_recorded_dspark_draft_reading_both_signals_costs_nothing(curve):
    """Replayed on a DSpark draft distilled for the demo target (tests/data/dspark_trace.json: per step its
    confidence head's predictions and its logits' argmax probabilities), whose head ranks proposals worse than
    the argmax probability: reading both (the better so far, chosen online) is within 2 % of the better signal
    alone, and never below the head's."""
    trace = json.loads((REPLAY.TRACE.parent / "dspark_trace.json").read_text())
    costs = REPLAY.curves(trace["verify_rows"])[curve]
    rates = {keys: simulate("auto", costs, REPLAY.recorded_steps(trace, *keys))["rate"]
             for keys in (("confidence",), ("argmax_probability",), ("confidence", "argmax_probability"))}
    both = rates[("confidence", "argmax_probability")]
    assert both >= 0.98 * max(rates[("confidence",)], rates[("argmax_probability",)]), rates
    assert both >= rates[("confidence",)], rates


FLAT_CHEAP = CostModel([1.0] * B, 0.2)  # by the curve, a drafted block costs 1.2 greedy steps


def drive(policy: VerifyPolicy, steps: int, drafted_wall_ms: float, ingested: int | None = None) -> int:
    """A draft that is always right, decoded for `steps` steps under `policy`, each step's time reported as
    measured: greedy steps at the curve's t(1), drafted steps at `drafted_wall_ms` (their draft call ingesting
    `ingested` rows: a verify's by default). Returns the draft calls made."""
    calls = 0
    for _ in range(steps):
        if policy.wants_draft(B - 1):
            calls += 1
            chosen = policy.choose(np.full(B - 1, 0.95), B - 1)
            policy.observe(chosen, chosen)
            policy.observe_time(chosen + 1 if ingested is None else ingested, chosen + 1, 1.0, drafted_wall_ms,
                                chosen + 1)
        else:
            policy.observe_time(0, 1, 1.0, 1.0, 1)
    return calls


def test_measured_step_costs_price_what_the_curve_leaves_out():
    """By the curve a drafted block costs 1.2 greedy steps and drafting always pays; measured, a drafted step
    takes 40 ms (a draft call, loop work the curve does not price) for 16 tokens, against 16 greedy steps'
    16 ms: the policy then drafts only to probe, and its probes back off; where drafted steps take what the
    curve says, it drafts every step. Each runs over a Measured kept across requests, as a decoder keeps it."""
    slow, fast = Measured(), Measured()
    slow_calls = sum(drive(verify_policy("auto", FLAT_CHEAP, B, [], slow), 100, 40.0) for _ in range(6))
    fast_calls = drive(verify_policy("auto", FLAT_CHEAP, B, [], fast), 100, 1.2)
    assert fast_calls == 100 and fast.drafted_ms == pytest.approx(0.2)
    assert slow.drafted_ms > 30 and slow_calls < 20 and slow.probe_wait > PROBE_MAX
    first = verify_policy("auto", FLAT_CHEAP, B, [], slow)  # a new request: what drafted steps delivered so far
    assert not first.wants_draft(B - 1)
    assert verify_policy("auto", FLAT_CHEAP, B, [], Measured()).wants_draft(B - 1)  # nothing measured: it drafts


def test_drafting_is_held_to_what_drafted_steps_delivered():
    """Steps whose draft call ingests many rows (after a greedy stretch) are no steady cost, but each drafted
    step's rate is compared with what was expected of it: delivered at under a tenth of the expected rate (16
    tokens in 24 ms, below greedy's one a millisecond), the policy stops drafting; delivered as expected, it goes
    on."""
    behind, on_time = Measured(), Measured()
    behind_calls = drive(verify_policy("auto", FLAT_CHEAP, B, [], behind), 200, 24.0, ingested=4 * B)
    on_time_calls = drive(verify_policy("auto", FLAT_CHEAP, B, [], on_time), 200, 1.2, ingested=4 * B)
    assert behind.drafted_ms is None and behind.realized < 0.1
    assert behind_calls < 12 and on_time_calls == 200 and on_time.realized == pytest.approx(1.0, rel=0.01)


def test_a_busier_machine_scales_the_curve():
    """Target calls measured at twice the curve's time: the policy prices every row count at twice the curve."""
    measured = Measured()
    policy = verify_policy("auto", CURVES[CPU], B, [], measured)
    for _ in range(100):
        policy.observe_time(0, 1, 2.0 * CURVES[CPU].verify_ms[0], 2.0 * CURVES[CPU].verify_ms[0], 1)
    assert measured.scale == pytest.approx(2.0, rel=1e-3)
    assert policy.greedy_rate == pytest.approx(1 / (2.0 * CURVES[CPU].verify_ms[0]), rel=1e-3)


def test_a_batched_request_pays_its_share_of_the_step():
    """shared_by(n, m): each of n requests verifying T tokens padded to m rows pays t(n * T') / n, the curve going on
    along its last half's slope past its measured rows; one request alone pays the padded curve."""
    costs = CostModel([1.0, 2.0, 3.0, 4.0], 0.5)
    assert costs.shared_by(2, 2).verify_ms == [2.0, 2.0, 4.0, 4.0]  # t(4) / 2, t(4) / 2, t(8) / 2 with t(8) = 8
    assert costs.shared_by(1, 2).verify_ms == costs.padded_to(2).verify_ms
    assert costs.shared_by(3).draft_ms == 0.5


def test_beside_other_requests_auto_verifies_less():
    """A step whose fixed cost is large beside its per-row cost: alone, verifying the whole block is nearly free;
    shared by 8 requests the fixed part is split and each drafted row costs what it does, so the same confidences
    earn fewer verified tokens (and repricing back restores the choice)."""
    costs = CostModel([10.0 + t for t in range(1, 17)], 1.0)
    policy = verify_policy("auto", costs, 16)
    confidences = np.full(15, 0.6, np.float32)
    alone = policy.choose(confidences, 15)
    policy.reprice(costs.shared_by(8))
    shared = policy.choose(confidences, 15)
    policy.reprice(costs)
    assert shared < alone == policy.choose(confidences, 15)


def test_the_last_step_of_a_request_finishes_it_rather_than_leave_a_token():
    """Calls padded to 2 rows: verifying 14 of 14 sure proposals (15 rows) costs a 16-row call, 13 (14 rows) a 14-row
    one, so by the rate of the step alone 13 wins; but the token it leaves costs a whole greedy step. Where the
    request's budget is within reach, the step that finishes soonest is chosen; mid-request and at a low
    confidence nothing changes."""
    costs = CostModel([10.0 + 6.0 * ((t + 1) // 2) for t in range(1, 17)], 14.0)
    policy = verify_policy("auto", costs, 16)
    sure = np.ones(15, np.float32)
    for _ in range(20):  # every proposal accepted: the top bin learns it
        assert policy.choose(sure, 15) == 15
        policy.observe(15, 15)
    bins = Calibration.bins(sure[:14])
    assert int(np.argmax(policy.rates(bins))) == 13  # what the step's own rate would pick
    assert policy.choose(sure[:14], 14) == 14
    policy.observe(14, 14)
    assert policy.choose(np.full(14, 0.05, np.float32), 14) <= 2


DEEP = CostModel([10.0 + t for t in range(1, 17)], 1.0, 256, "lower",
                 [{"context": 1024, "verify_ms": [12.0 + 4 * t for t in range(1, 17)], "draft_ms": 2.0},
                  {"context": 4096, "verify_ms": [20.0 + 16 * t for t in range(1, 17)], "draft_ms": 6.0}])


def test_a_curve_measured_at_several_contexts_is_priced_at_the_depth_asked():
    """Linear in the context between the measured ones, the shallowest below them, the last segment's slope beyond
    the deepest; one curve again, non-decreasing in rows; a curve of one context is itself at every depth."""
    assert DEEP.at_depth(100).verify_ms == DEEP.verify_ms and DEEP.at_depth(100).deeper == []
    middle = DEEP.at_depth(640)  # halfway from 256 to 1024
    assert middle.verify_ms[0] == pytest.approx((11.0 + 16.0) / 2) and middle.draft_ms == pytest.approx(1.5)
    assert DEEP.at_depth(4096).verify_ms == DEEP.deeper[1]["verify_ms"]
    beyond = DEEP.at_depth(7168)  # one more segment of 3072 past 4096
    assert beyond.verify_ms[15] == pytest.approx(276.0 + (276.0 - 76.0)) and beyond.draft_ms == pytest.approx(10.0)
    assert all(b >= a for a, b in zip(beyond.verify_ms, beyond.verify_ms[1:])) and beyond.context == 7168
    flat = CostModel([1.0] * 4, 0.5)
    assert flat.at_depth(8192) is flat
    with pytest.raises(ValueError, match="rising"):
        CostModel([1.0] * 4, 0.5, 256, deeper=[{"context": 128, "verify_ms": [2.0] * 4, "draft_ms": 1.0}])


def test_a_deep_request_verifies_what_its_depth_pays_for():
    """Where attention at 4K makes each verified row dear (t(16) 14x t(1) there, 2.4x at 256), the same confidences
    earn a long verify at the prompt's start and a short one deep in the context: the request's pricing follows its
    depth, one repricing per depth step, and its width when batched."""
    from dflash_onnx.runtime.request import StepPricing

    confidences = np.full(15, 0.8, np.float32)
    policy = verify_policy("auto", DEEP, 16)
    pricing = StepPricing(DEEP, row_multiple=1)
    pricing.update(policy, 200)
    shallow = policy.choose(confidences, 15)
    pricing.update(policy, 4500)
    deep = policy.choose(confidences, 15)
    assert deep < shallow and policy.costs.context == 4096  # 4500 is priced at its depth step's shallow end
    pricing.update(policy, 4600)  # the same depth step: nothing repriced
    assert len(pricing.curves) == 2 and policy.costs.context == 4096

    class Batch:
        active, drafting = 4, True

    batched = StepPricing(DEEP, row_multiple=1, batch=Batch())
    batched.update(policy, 200)
    assert policy.costs.verify_ms == DEEP.at_depth(181).shared_by(4).verify_ms  # 2 ** (30 / 4): 200's step
