"""dflash.json: the typed lowering record round-trips, format 1 exports still load, format 1 lowerings are
refused with what to do, and a damaged file says so in one line."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from fakes import make_manifest

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import FORMAT_VERSION, MANIFEST_NAME, Lowering, load_export, load_manifest


def _written(tmp_path, manifest) -> dict:
    for graph in (manifest.target, manifest.draft):
        (tmp_path / graph.file).write_bytes(b"")
    manifest.save(tmp_path)
    return json.loads((tmp_path / MANIFEST_NAME).read_text())


def test_the_lowering_record_round_trips_typed(tmp_path):
    lowering = Lowering(backend="ort", options={"ctx_len": 64}, provider="cpu", draft_kv="rows",
                        shared_with_target={"d.embed": "t.embed"},
                        rewrites={"kv-buffer": {"target": {"attentions": 1}}}, max_relative_difference=1e-6)
    raw = _written(tmp_path, make_manifest(form="buffer", ctx_len=64, lowering=lowering))
    assert raw["format_version"] == FORMAT_VERSION == 2 and raw["lowering"]["backend"] == "ort"
    loaded = load_manifest(tmp_path)
    assert isinstance(loaded.lowering, Lowering) and loaded.lowering == lowering and loaded.backend == "ort"
    with pytest.raises(DFlashError, match=r"already lowered \(for ort\)"):
        load_export(tmp_path, "lower")


def test_an_export_has_no_lowering(tmp_path):
    raw = _written(tmp_path, make_manifest())
    assert raw["lowering"] is None
    assert load_export(tmp_path, "lower").backend is None


def test_a_format_1_export_still_loads(tmp_path):
    raw = _written(tmp_path, make_manifest())
    raw.update(format_version=1, lowering={})  # how format 1 wrote an export
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    manifest = load_export(tmp_path, "lower")
    assert manifest.lowering is None and manifest.format_version == FORMAT_VERSION


def test_a_format_1_lowering_is_refused_with_what_to_run(tmp_path):
    raw = _written(tmp_path, make_manifest(form="buffer", ctx_len=64))
    raw.update(format_version=1, lowering={"target": "ort", "provider": "cpu", "session_options": {}})
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(DFlashError, match="older dflash-onnx .*format 1.*re-run 'dflash-onnx lower'"):
        load_manifest(tmp_path)


@pytest.mark.parametrize("damage, message", [
    (lambda raw: raw.update(format_version=7), "format_version 7 is not 2"),
    (lambda raw: raw["lowering"].update(colour="blue"), "is corrupt"),
    (lambda raw: raw.update(form="sideways"), "is corrupt"),
    (lambda raw: raw.pop("target"), "is corrupt"),
])
def test_damaged_manifests_are_refused_in_one_line(tmp_path, damage, message):
    raw = _written(tmp_path, make_manifest(lowering=Lowering(backend="mlx", options={})))
    damage(raw)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(DFlashError, match=message):
        load_manifest(tmp_path)


def test_options_another_version_wrote_are_refused_when_a_session_opens(tmp_path):
    from dflash_onnx.targets import open_session

    manifest = make_manifest(lowering=Lowering(backend="ort", options={"colour": "blue"}, provider="cpu"))
    _written(tmp_path, manifest)
    with pytest.raises(DFlashError, match="ort options do not match this dflash-onnx .*re-run 'dflash-onnx lower'"):
        open_session(tmp_path, load_manifest(tmp_path), "target")


def test_every_field_is_written(tmp_path):
    manifest = make_manifest(lowering=Lowering(backend="coreml", options={"ctx_len": 96}, padding="consecutive"))
    assert _written(tmp_path, manifest)["lowering"] == asdict(manifest.lowering)
