"""Pair validation: each mismatch is caught before any work, with both values named."""

from __future__ import annotations

import json

import pytest

from dflash_onnx.exporter.export import export_pair
from dflash_onnx.exporter.models.draft import DraftSpec
from dflash_onnx.exporter.pair import TargetInfo, validate_pair
from dflash_onnx.exporter.tiny import TinySpec, build_pair
from dflash_onnx.runtime.errors import DFlashError


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return build_pair(TinySpec(block_size=4), tmp_path_factory.mktemp("pair"))


def _edited_draft(draft_dir, **changes) -> DraftSpec:
    raw = json.loads((draft_dir / "config.json").read_text())
    for key, value in changes.items():
        if key in ("target_layer_ids", "block_size", "mask_token_id"):
            raw["dflash_config"][key] = value
        else:
            raw[key] = value
    return DraftSpec.from_dict(raw)


@pytest.mark.parametrize("changes,message", [
    ({"hidden_size": 32}, "draft hidden_size 32 != target hidden_size 64"),
    ({"vocab_size": 50}, "draft vocab_size 50 != target vocab_size 96"),
    ({"num_target_layers": 6}, "draft num_target_layers 6 != target num_hidden_layers 4"),
    ({"target_layer_ids": [1, 4]}, r"has 4, outside the target's layers 0..3"),
    ({"mask_token_id": 96}, "mask_token_id 96 is outside the target vocab \\(size 96\\)"),
])
def test_mismatches_name_both_values(pair_dirs, changes, message):
    target_dir, draft_dir = pair_dirs
    with pytest.raises(DFlashError, match=message):
        validate_pair(TargetInfo.from_dir(target_dir), _edited_draft(draft_dir, **changes))


def test_block_size_rules(pair_dirs):
    target_dir, draft_dir = pair_dirs
    info, spec = TargetInfo.from_dir(target_dir), DraftSpec.from_dir(draft_dir)
    assert validate_pair(info, spec) == 4
    assert validate_pair(info, spec, block_size=2) == 2
    with pytest.raises(DFlashError, match="at least 2"):
        validate_pair(info, spec, block_size=1)
    with pytest.raises(DFlashError, match="above the draft's trained block size 4.*--allow-longer-block"):
        validate_pair(info, spec, block_size=8)
    assert validate_pair(info, spec, block_size=8, allow_longer_block=True) == 8
    with pytest.raises(DFlashError, match="dtype 'float64' is not supported"):
        validate_pair(info, spec, dtype="float64")


def test_missing_directories_and_configs(tmp_path, pair_dirs):
    target_dir, draft_dir = pair_dirs
    with pytest.raises(DFlashError, match="has no config.json"):
        TargetInfo.from_dir(tmp_path)
    with pytest.raises(DFlashError, match="has no config.json"):
        DraftSpec.from_dir(tmp_path)
    with pytest.raises(DFlashError, match="no 'num_target_layers'"):
        DraftSpec.from_dict({"hidden_size": 8})


def test_invalid_exports_are_refused_before_any_work(tmp_path, pair_dirs):
    target_dir, draft_dir = pair_dirs
    out = tmp_path / "out"
    with pytest.raises(DFlashError):
        export_pair(target_dir, draft_dir, out, block_size=1, progress=False)
    with pytest.raises(DFlashError, match="opset 12"):
        export_pair(target_dir, draft_dir, out, opset=12, progress=False)
    with pytest.raises(DFlashError, match="would replace the model directory"):
        export_pair(target_dir, draft_dir, target_dir.parent, overwrite=True, progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DFlashError, match="not a directory"):
        export_pair(target_dir, draft_dir, tmp_path / "file", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_failure_mid_export_leaves_no_output_and_keeps_the_old_one(tmp_path, pair_dirs, monkeypatch):
    import dflash_onnx.exporter.export as export_module

    target_dir, draft_dir = pair_dirs
    out = tmp_path / "out"
    out.mkdir()
    (out / "previous.txt").write_text("an earlier export")

    def broken_draft_export(*args, **kwargs):
        raise DFlashError("simulated failure while exporting the draft")

    monkeypatch.setattr(export_module, "export_draft", broken_draft_export)
    with pytest.raises(DFlashError, match="simulated failure"):
        export_pair(target_dir, draft_dir, out, overwrite=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dir left behind
    assert (out / "previous.txt").read_text() == "an earlier export"


def test_stop_tokens_come_from_generation_config(pair_dirs):
    target_dir, _ = pair_dirs
    assert TargetInfo.from_dir(target_dir).stop_token_ids == [1]


def test_a_stage_the_machine_cannot_hold_is_refused_up_front(tmp_path, pair_dirs, exported, monkeypatch):
    """Export, weight-loading passes and the ORT, AI 100 and CoreML lowerings estimate their peak memory from their
    weights (measured factors) and refuse, naming both figures, before anything is written; the environment
    variable lets a user try."""
    import dflash_onnx.artifacts.publish as publish
    from dflash_onnx.artifacts.publish import MEMORY_CHECK_ENV, available_memory, staged_directory

    assert available_memory() is None or available_memory() > 0
    target_dir, draft_dir = pair_dirs
    source = exported("agree_b8").out
    monkeypatch.setattr(publish, "available_memory", lambda: 1024)
    with pytest.raises(DFlashError, match=r"needs about .* of memory at its peak and this machine has 0.0 MiB "
                                          r"available .*DFLASH_ONNX_NO_MEMORY_CHECK=1"):
        export_pair(target_dir, draft_dir, tmp_path / "out", progress=False)
    from dflash_onnx.passes.pipeline import apply_pipeline
    from dflash_onnx.targets import LowerRequest
    from dflash_onnx.targets.ort.lower import lower_ort

    with pytest.raises(DFlashError, match="of memory at its peak"):
        apply_pipeline(source, ["fp16"], tmp_path / "fp16", {}, progress=False)  # loads the weights
    apply_pipeline(source, ["cleanup"], tmp_path / "cleaned", {}, progress=False)  # structure only: no estimate
    apply_pipeline(source, ["int4"], tmp_path / "int4", {}, progress=False)  # tensor by tensor: no estimate
    with pytest.raises(DFlashError, match="of memory at its peak"):
        lower_ort(source, tmp_path / "ort", request=LowerRequest(progress=False))
    from dflash_onnx.targets.ai100.lower import lower_ai100
    from dflash_onnx.targets.ai100.options import Ai100Options
    from dflash_onnx.targets.coreml.lower import lower_coreml

    with pytest.raises(DFlashError, match="of memory at its peak"):  # re-exports from the loaded pair
        lower_ai100(source, tmp_path / "ai100", Ai100Options(dry_run=True), LowerRequest(progress=False))
    with pytest.raises(DFlashError, match="of memory at its peak"):  # traces the pair in float32
        lower_coreml(source, tmp_path / "coreml", request=LowerRequest(progress=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cleaned", "int4"]
    monkeypatch.setenv(MEMORY_CHECK_ENV, "1")
    with staged_directory(tmp_path / "forced", need_memory=10**15) as staging:
        (staging / "file").write_text("x")
    assert (tmp_path / "forced" / "file").read_text() == "x"
