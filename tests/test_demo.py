"""`dflash-onnx demo`, the README's main job: builds, exports (cached) and compares greedy with DFlash."""

from __future__ import annotations

import json

from dflash_onnx.demo import run_demo


def test_demo_runs_offline_and_is_lossless(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DFLASH_ONNX_CACHE", str(tmp_path))
    assert run_demo(as_json=True, max_new_tokens=24, num_prompts=2) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["all_identical_to_greedy"] and summary["tau"] > 1 and summary["costs"]["verify_ms"]
    assert {"greedy_tokens_per_second", "full_tokens_per_second", "auto_tokens_per_second"} <= set(summary)
    exported = next(tmp_path.rglob("dflash.json")).stat().st_mtime
    assert run_demo(as_json=True, max_new_tokens=8, num_prompts=1) == 0  # second run reuses the export
    assert next(tmp_path.rglob("dflash.json")).stat().st_mtime == exported
