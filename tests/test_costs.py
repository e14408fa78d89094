"""The cost curve the auto verify policy weighs: measured at lowering, refreshed or replayed by `calibrate`,
replaced per run by --cost-model."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash_onnx.cli import main
from dflash_onnx.runtime.costs import read_costs
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest


def test_the_ort_lowering_records_a_non_decreasing_curve(ort_lowered):
    manifest = load_manifest(ort_lowered("agree_b8"))
    costs = manifest.costs
    assert costs.source == "lower" and len(costs.verify_ms) == manifest.block_size and costs.draft_ms > 0
    assert costs.verify_ms == sorted(costs.verify_ms) and costs.context == 256
    # and again deeper, where long requests are priced: 1K, 4K and 16K, each cut to what the 512-row buffers hold
    # besides two blocks of 8 (so once, at 496)
    assert [curve["context"] for curve in costs.deeper] == [496] and manifest.ctx_len == 512
    for curve in costs.deeper:
        assert curve["verify_ms"] == sorted(curve["verify_ms"]) and curve["draft_ms"] > 0


def test_the_curve_holds_one_graph_at_a_time(ort_lowered):
    """The target's session is released before the draft's opens: the measurement's peak memory is one graph's
    (at the Qwen3-4B shape the draft session alone holds 0.76 GB, its int4 lm_head packed again)."""
    import gc
    import weakref

    from dflash_onnx.runtime.costs import measure_costs
    from dflash_onnx.targets import open_session

    directory = ort_lowered("agree_b8")
    manifest, alive = load_manifest(directory), {}

    def open_graph(graph: str):
        gc.collect()
        alive[graph] = [name for name, ref in opened.items() if ref() is not None]
        session = open_session(directory, manifest, graph)
        opened[graph] = weakref.ref(session)
        return session

    opened: dict = {}
    costs = measure_costs(manifest, open_graph, context=16, repeats=1)
    assert alive == {"target": [], "draft": []} and len(costs.verify_ms) == manifest.block_size


@pytest.fixture
def export_copy(exported, tmp_path):
    out = tmp_path / "export"
    shutil.copytree(exported("agree_b8").out, out)
    return out


def test_calibrate_measures_or_replays_into_the_manifest(export_copy, tmp_path, capsys):
    assert load_manifest(export_copy).costs is None  # an export has none: auto verifies full blocks there
    assert main(["calibrate", str(export_copy), "--context", "32", "--repeats", "2", "--depths", "64,128"]) == 0
    measured = load_manifest(export_copy).costs
    assert measured.source == "calibrate" and measured.context == 32 and len(measured.verify_ms) == 8
    assert [curve["context"] for curve in measured.deeper] == [64, 128]
    assert "at context 128: " in capsys.readouterr().out
    for depths in ("16", "128,64", "deep", "9000"):  # not past --context, not rising, not numbers, beyond 4096
        assert main(["calibrate", str(export_copy), "--context", "32", "--depths", depths]) == 2
        assert f"--depths {depths}:" in capsys.readouterr().err
    curve = tmp_path / "m2.json"
    curve.write_text(json.dumps({"verify_ms": [1 + 0.43 * t for t in range(8)], "draft_ms": 1.0}))
    assert main(["calibrate", str(export_copy), "--from", str(curve)]) == 0
    assert load_manifest(export_copy).costs.source == str(curve)
    assert "recorded in" in capsys.readouterr().out


def test_a_replayed_curve_steers_generate(export_copy, tmp_path, capsys):
    free = tmp_path / "free.json"
    free.write_text(json.dumps({"verify_ms": [1.0] * 8, "draft_ms": 0.01}))
    costly = tmp_path / "costly.json"
    costly.write_text(json.dumps({"verify_ms": [1.0] + [50.0] * 7, "draft_ms": 50.0}))
    verified = {}
    for name, curve in (("free", free), ("costly", costly)):
        assert main(["generate", str(export_copy), "--prompt-ids", "3,4,5", "--max-new-tokens", "30",
                     "--cost-model", str(curve), "--json"]) == 0
        verified[name] = json.loads(capsys.readouterr().out)
    assert verified["free"]["tokens"] == verified["costly"]["tokens"]  # the same greedy output either way
    assert set(verified["free"]["verified"][:-1]) == {7}  # free verification: whole blocks
    assert verified["costly"]["verified"].count(0) > len(verified["costly"]["verified"]) // 2  # mostly greedy


@pytest.mark.parametrize("content, message", [
    ("{not json", "give a JSON object with verify_ms"),
    ('{"verify_ms": [1, 2], "draft_ms": 1}', "verify_ms has 2 entries, the block needs 8"),
    ('{"verify_ms": [0, 1, 1, 1, 1, 1, 1, 1], "draft_ms": 1}', "positive verify_ms"),
    ('{"verify_ms": [1, 1, 1, 1, 1, 1, 1, 1], "draft_ms": 1, "context": 256, "deeper": [{"context": 64, '
     '"verify_ms": [2, 2, 2, 2, 2, 2, 2, 2], "draft_ms": 1}]}', "contexts rising past its own"),
])
def test_bad_cost_files_get_one_line(content, message, tmp_path, export_copy, capsys):
    path = tmp_path / "curve.json"
    path.write_text(content)
    with pytest.raises(DFlashError, match=message):
        read_costs(path, 8)
    assert main(["calibrate", str(export_copy), "--from", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_graphs_at_compiled_sizes_take_a_replayed_curve(lowered, capsys):
    directory, _ = lowered("agree_b8")
    assert main(["calibrate", str(directory)]) == 2
    assert "calibrate DIR --from FILE" in capsys.readouterr().err


def test_a_lowering_too_slow_to_measure_leaves_it_to_calibrate(exported, tmp_path, monkeypatch, capsys):
    """Measurements whose fewest calls would outlast the budget are skipped with a warning naming the figures;
    `calibrate` later records the row multiple and the cost curve the lowering would have."""
    from dflash_onnx.targets import lowering
    from dflash_onnx.targets.backend import LowerRequest
    from dflash_onnx.targets.ort.lower import lower_ort
    from dflash_onnx.targets.ort.options import OrtOptions
    from dflash_onnx.targets.row_invariance import fewest_calls

    monkeypatch.setattr(lowering, "MEASUREMENT_BUDGET_S", 0.0)
    out = tmp_path / "ort"
    lower_ort(exported("agree_b8").out, out, OrtOptions(ctx_len=512), LowerRequest(progress=False))
    manifest = load_manifest(out)
    contexts = [256, 496]  # the curve's own and what the 512-row buffers hold besides two blocks of 8
    calls = fewest_calls(manifest) + (lowering.COST_REPEATS + 1) * manifest.block_size * len(contexts)
    warning = capsys.readouterr().err
    assert "measuring batch invariance and the cost curve is skipped: one decode call took" in warning
    assert f"its {calls} calls" in warning
    assert "calibrate DIR" in warning
    assert manifest.costs is None and "batch_invariance" not in manifest.lowering.report
    assert manifest.lowering.options["spinning"] == "auto"  # not timed either: the sessions spin (as before)
    monkeypatch.undo()
    assert main(["calibrate", str(out), "--repeats", "2"]) == 0
    manifest = load_manifest(out)
    assert manifest.costs.source == "calibrate" and "row multiple" in capsys.readouterr().out
    assert [curve["context"] for curve in manifest.costs.deeper] == contexts[1:]
    assert manifest.lowering.report["batch_invariance"]["row_multiple"] == manifest.lowering.row_multiple


def test_fewest_calls_is_what_the_measurement_makes_at_least(ort_lowered):
    """The budget's count: the calls measure_row_multiple makes when the first candidate agrees (more when not)."""
    from dflash_onnx.targets.ort.session import open_session
    from dflash_onnx.targets.row_invariance import CANDIDATES, fewest_calls, measure_row_multiple

    directory = ort_lowered("agree_b8")
    manifest = load_manifest(directory)

    class Counted:
        def __init__(self, session):
            self.session, self.calls = session, 0

        def __getattr__(self, name):
            return getattr(self.session, name)

        def run(self, feeds, output_names=None):
            self.calls += 1
            return self.session.run(feeds, output_names)

    counted = Counted(open_session(directory, manifest, "target"))
    measured = measure_row_multiple(manifest, counted)
    first = measured["row_multiple"] == CANDIDATES[0] and measured["invariant"]
    assert counted.calls == fewest_calls(manifest) if first else counted.calls > fewest_calls(manifest)


class _ClockedSession:
    """A session whose call of T rows takes T ms on a fake clock, 20x that once `busy_after` calls have run
    (a neighbour that starts halfway through the measurement)."""

    def __init__(self, clock: list[float], busy_after: int):
        self.clock, self.busy_after, self.calls = clock, busy_after, 0

    def run(self, feeds, names):
        self.calls += 1
        rows = feeds["input_ids"].shape[1]
        self.clock[0] += rows * (20 if self.calls > self.busy_after else 1) / 1000


def test_a_neighbour_that_starts_halfway_cannot_steepen_the_curve(monkeypatch):
    """Measured T after T (the old way), a busy neighbour arriving halfway made the long verifies look 20x dear;
    interleaved rounds keeping each T's fastest give every T its quiet time."""
    import numpy as np

    from dflash_onnx.runtime import costs

    clock = [0.0]
    monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])
    calls = [{"input_ids": np.zeros((1, rows), np.int64)} for rows in range(1, 9)]
    session = _ClockedSession(clock, busy_after=8 * 6)  # quiet for the warm-up and 5 rounds of 10
    assert costs.interleaved_min_ms(session, calls, ["x"], repeats=10) == pytest.approx(list(range(1, 9)))
    assert session.calls == 8 * 11
    sequential = _ClockedSession(clock, busy_after=8 * 6)
    old = [costs.call_ms(sequential, feeds, ["x"], 10) for feeds in calls]
    assert old[-1] / old[0] > 50  # what the median of back-to-back calls recorded


def test_a_decode_says_when_its_steps_disagree_with_the_curve():
    from dflash_onnx.runtime.costs import curve_disagreement
    from dflash_onnx.runtime.manifest import CostModel

    steep = CostModel(verify_ms=[1.0 + 1.2 * t for t in range(16)], draft_ms=1.0)  # t(16) 19 ms, 10x t(1)
    greedy_steps, full_steps = [0] * 10, [15] * 4
    quiet = [2.2] * 10 + [3.0] * 4  # this run: t(1) 2.2 ms (2x slower), t(16) 3 ms (6x cheaper)
    message = curve_disagreement(steep, greedy_steps + full_steps, quiet)
    assert message and "t(16) 19.00 ms recorded, 3.00 observed: it was measured while other work" in message
    assert "calibrate" in message
    bent = [1.0] * 10 + [19.0 * 2.5] * 4  # t(1) as recorded, t(16) 2.5x: less than the margin
    assert curve_disagreement(steep, greedy_steps + full_steps, bent) is None
    bent = [1.0] * 10 + [19.0 * 4] * 4  # t(16) 4x what t(1)'s ratio says: the shape is off
    message = curve_disagreement(steep, greedy_steps + full_steps, bent)
    assert "t(1) 1.00 ms recorded, 1.00 observed; t(16) 19.00 ms recorded, 76.00 observed" in message
    slower = [2.0] * 10 + [2 * 19.0] * 4  # a machine 2x slower throughout: the shape holds
    assert curve_disagreement(steep, greedy_steps + full_steps, slower) is None
    assert curve_disagreement(steep, greedy_steps + [15] * 2, quiet[:12]) is None  # two long steps: too few
    assert curve_disagreement(None, greedy_steps, [1.0] * 10) is None


def test_generate_reports_the_curve_check(ort_lowered, tmp_path, capsys):
    """A lowering whose recorded curve is far steeper than the machine: generate --json names it, and the
    stats line's warning says how to re-measure. (The policy, measuring the steps, verifies longer blocks than the
    curve alone would let it; the warning is what tells the user to re-measure.)"""
    directory = tmp_path / "ort"
    shutil.copytree(ort_lowered("agree_b8"), directory)
    manifest = json.loads((directory / "dflash.json").read_text())
    costs = manifest["costs"]
    costs["verify_ms"] = [costs["verify_ms"][0] * (1 + 40 * t) for t in range(len(costs["verify_ms"]))]
    (directory / "dflash.json").write_text(json.dumps(manifest))
    args = ["generate", str(directory), "--prompt-ids", "3,4,5,6", "--max-new-tokens", "60", "--verify"]
    assert main([*args, "auto", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "other work shared the machine" in report["curve_check"]
    assert main([*args, "auto"]) == 0
    assert "warning: the cost curve the verify policy weighs disagrees" in capsys.readouterr().err
