"""`dflash-onnx demo`, the README's main job: builds, exports (cached) and compares greedy with DFlash."""

from __future__ import annotations

import json

from dflash_onnx.demo import COLUMNS, run_demo


def test_demo_runs_offline_and_is_lossless(tmp_path, monkeypatch, capsys):
    """Every column (plain greedy, greedy with the lookup guess, DFlash full and auto) in interleaved rounds, each
    run's tokens plain greedy's; the table names each column and says where DFlash pays."""
    monkeypatch.setenv("DFLASH_ONNX_CACHE", str(tmp_path))
    assert run_demo(as_json=True, max_new_tokens=24, num_prompts=2, rounds=2) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["all_identical_to_greedy"] and summary["tau"] > 1 and summary["costs"]["verify_ms"]
    assert summary["rounds"] == 2 and set(summary["moved"]) == set(COLUMNS)
    assert all(summary[f"{mode}_tokens_per_second"] > 0 for mode in COLUMNS)
    assert summary["where_dflash_pays"].startswith("where DFlash pays")
    exported = next(tmp_path.rglob("dflash.json")).stat().st_mtime
    assert run_demo(max_new_tokens=8, num_prompts=1, rounds=1) == 0  # second run reuses the export
    assert next(tmp_path.rglob("dflash.json")).stat().st_mtime == exported
    printed = capsys.readouterr().out
    assert all(column in printed for column in COLUMNS.values()) and "where DFlash pays" in printed
