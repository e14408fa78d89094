"""Checkpoints by Hugging Face hub name (dflash_onnx/artifacts/hub.py), against a hub cache the tests lay out
(`models--ORG--NAME/snapshots/COMMIT/...`, `refs/BRANCH` holding the commit) with HF_HUB_OFFLINE=1: nothing is
downloaded. A pair finds its other half: a z-lab draft's target and a target's z-lab draft from the published table,
a speculators draft's target from its verifier."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest

from dflash_onnx.artifacts.hub import checkpoints, resolve_checkpoint, resolve_pair, snapshot_origin
from dflash_onnx.cli import main
from dflash_onnx.exporter.tiny import TinySpec, build_pair
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets.backend import LowerRequest
from dflash_onnx.targets.lowering import start_lowering
from dflash_onnx.targets.ort.options import OrtOptions

COMMIT_T, COMMIT_T2, COMMIT_D = "1" * 40, "2" * 40, "d" * 40
PAIR = TinySpec(agree=True, tie_embeddings=False, block_size=4, target_layer_ids=[1, 2], seed=31)
OTHER = TinySpec(hidden_size=32, num_heads=2, head_dim=16, block_size=4, target_layer_ids=[1], seed=37)


class _RunsCode:
    """A pickle that writes the marker file when it is loaded (as a `*.bin` weight file can)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def cache(hub: Path, repo_id: str, source: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """`source` laid out in the hub cache as `repo_id` at `commit`, which `refs` name; returns the snapshot."""
    root = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot


def plant_code(snapshot: Path, marker: Path) -> None:
    """What a whole-repo download may hold beside the weights: a model's Python file and pickle weights, each of
    which writes `marker` if it ever runs."""
    (snapshot / "modeling_custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (snapshot / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsCode(marker)))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    built = {"pair": build_pair(PAIR, root / "pair"), "other": build_pair(OTHER, root / "other"),
             "speculators": build_pair(dataclasses.replace(PAIR, draft_format="speculators"), root / "speculators")}
    return built


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty hub cache, offline, for this process (huggingface_hub read its environment at import)."""
    path = tmp_path / "hub"
    path.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(path))
    monkeypatch.setenv("HF_HUB_CACHE", str(path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return path


def _cli(hub: Path, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_HUB_CACHE=str(hub), HF_HOME=str(home), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "dflash_onnx", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def test_export_by_hub_name_from_the_cache_records_repo_and_commit(pairs, tmp_path):
    """`export --target org/name --draft org/draft` in a fresh process with only the environment pointing at the
    cache; the snapshots also hold a model's Python file and pickle weights, which never run and are never copied."""
    hub, marker, out = tmp_path / "hub", tmp_path / "code-ran", tmp_path / "out"
    target, draft = pairs["pair"]
    for snapshot in (cache(hub, "org/target", target, COMMIT_T), cache(hub, "org/draft", draft, COMMIT_D)):
        plant_code(snapshot, marker)
    done = _cli(hub, tmp_path / "home", "export", "--target", "org/target", "--draft", "org/draft", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert f"target org/target at {COMMIT_T}: {hub}" in done.stderr
    manifest = load_manifest(out)
    assert manifest.hub == {"target": {"repo_id": "org/target", "revision": COMMIT_T},
                            "draft": {"repo_id": "org/draft", "revision": COMMIT_D}}
    assert manifest.source_dirs["target"] == str((hub / "models--org--target" / "snapshots" / COMMIT_T).resolve())
    assert not marker.exists(), "a snapshot's Python file or pickle ran"
    written = {p.name for p in out.iterdir()}
    assert {"target.onnx", "draft.onnx", "dflash.json", "tokenizer.json"} <= written
    assert not [n for n in written if n.endswith((".py", ".bin"))]


def test_offline_and_not_cached_is_one_line_with_the_download_command(pairs, tmp_path):
    hub = tmp_path / "hub"
    hub.mkdir()
    done = _cli(hub, tmp_path / "home", "export", "--target", "org/absent", "--revision", "v2", "--draft",
                "org/absent-draft", "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"dflash-onnx export: error: target org/absent (revision v2) is not a directory and "
                                  f"not in the Hugging Face cache ({hub}), and HF_HUB_OFFLINE is set: fetch it where "
                                  "the hub is reachable with: ")
    assert ("hf download org/absent --revision v2 --include config.json --include '*.safetensors' "
            "--include '*.safetensors.index.json' --include tokenizer.json") in done.stderr
    assert done.stderr.rstrip().endswith("--include generation_config.json --exclude '*/*'")
    assert not (tmp_path / "out").exists()


def test_a_name_neither_a_directory_nor_a_repo_id_is_one_line(pairs, hub, tmp_path, capsys):
    _, draft = pairs["pair"]
    for name, said in (("not a model!", "target 'not a model!' is neither a directory nor a Hugging Face hub name "
                                        "(org/name)"),
                       (str(tmp_path / "nowhere"), "does not exist"),
                       ("org/absent", "target org/absent (revision main) is not a directory and not in the Hugging "
                                      "Face cache")):
        assert main(["export", "--target", name, "--draft", str(draft), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err


def test_revision_picks_the_snapshot(pairs, hub):
    target, _ = pairs["pair"]
    cache(hub, "org/target", target, COMMIT_T)
    pinned = cache(hub, "org/target", target, COMMIT_T2, refs=("v2",))
    assert snapshot_origin(resolve_checkpoint("org/target", "target"))["revision"] == COMMIT_T
    assert resolve_checkpoint("org/target", "target", "v2") == pinned  # a tag or branch, through refs/
    assert resolve_checkpoint("org/target", "target", COMMIT_T2) == pinned  # a commit
    assert snapshot_origin(pinned) == {"repo_id": "org/target", "revision": COMMIT_T2}
    with pytest.raises(DFlashError, match="hf download org/target --revision v3 "):
        resolve_checkpoint("org/target", "target", "v3")
    with pytest.raises(DFlashError, match="--revision v2 names a hub revision, but target .* is a directory"):
        resolve_checkpoint(target, "target", "v2")


@pytest.fixture
def published(pairs, hub):
    """The tiny pair cached as z-lab's Qwen3-4B draft and its target; the other pair's draft as z-lab's Qwen3-8B
    draft, beside the first pair's target as Qwen/Qwen3-8B: a pair that does not match."""
    target, draft = pairs["pair"]
    cache(hub, "Qwen/Qwen3-4B", target, COMMIT_T)
    cache(hub, "z-lab/Qwen3-4B-DFlash-b16", draft, COMMIT_D)
    cache(hub, "Qwen/Qwen3-8B", target, COMMIT_T)
    cache(hub, "z-lab/Qwen3-8B-DFlash-b16", pairs["other"][1], COMMIT_D)
    return hub


def test_a_draft_alone_exports_with_its_published_target(published, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", "--draft", "z-lab/Qwen3-4B-DFlash-b16", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "target Qwen/Qwen3-4B: the published pair of z-lab/Qwen3-4B-DFlash-b16 (dflash, block 16)" in err
    manifest = load_manifest(out)
    assert manifest.hub == {"target": {"repo_id": "Qwen/Qwen3-4B", "revision": COMMIT_T},
                            "draft": {"repo_id": "z-lab/Qwen3-4B-DFlash-b16", "revision": COMMIT_D}}
    # parity and bench find the checkpoints again from the recorded hub names once the recorded directories move
    snapshots = {kind: Path(d) for kind, d in manifest.source_dirs.items()}
    moved = dataclasses.replace(manifest, source_dirs={"target": "/gone/target", "draft": "/gone/draft"})
    assert checkpoints(moved) == (snapshots["target"], snapshots["draft"])
    assert checkpoints(manifest, target="Qwen/Qwen3-4B")[0] == snapshots["target"]  # at the recorded commit
    # so do the lowerings that convert the checkpoints again (ai100, coreml), given --target-dir / --draft-dir names
    moved_dir = tmp_path / "moved"
    shutil.copytree(out, moved_dir)
    moved.save(moved_dir)
    request = LowerRequest(target_dir="Qwen/Qwen3-4B", draft_dir="z-lab/Qwen3-4B-DFlash-b16")
    found = start_lowering(moved_dir, tmp_path / "lowered", OrtOptions(), request, reexport=True)[1]
    assert found == (snapshots["target"], snapshots["draft"])
    assert start_lowering(moved_dir, tmp_path / "lowered", OrtOptions(), LowerRequest(), reexport=True)[1] == found
    dataclasses.replace(moved, hub={}).save(moved_dir)  # no hub names recorded: the flag that gives one is named
    with pytest.raises(DFlashError, match="the draft checkpoint /gone/draft is gone: pass --draft-dir"):
        start_lowering(moved_dir, tmp_path / "lowered", OrtOptions(), LowerRequest(target_dir="Qwen/Qwen3-4B"),
                       reexport=True)


def test_draft_auto_picks_the_published_draft_of_the_target(published, capsys):
    target_dir, draft_dir = resolve_pair("Qwen/Qwen3-4B", "auto")
    assert snapshot_origin(draft_dir) == {"repo_id": "z-lab/Qwen3-4B-DFlash-b16", "revision": COMMIT_D}
    assert "draft z-lab/Qwen3-4B-DFlash-b16 (dflash, block 16): the published draft of Qwen/Qwen3-4B" in (
        capsys.readouterr().err)
    assert resolve_pair(target_dir, "auto")[1] == draft_dir  # a cache snapshot's directory goes by its repo id
    cache(published, "org/unknown", target_dir, COMMIT_T)
    with pytest.raises(DFlashError, match="--draft auto: no published draft is known for org/unknown"):
        resolve_pair("org/unknown", "auto")
    with pytest.raises(DFlashError, match="pass --target too"):
        resolve_pair(None, "auto")


def test_a_pair_that_does_not_match_is_refused_in_one_line(published, tmp_path, capsys):
    assert main(["export", "--target", "Qwen/Qwen3-8B", "--draft", "auto", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("dflash-onnx export: error: target and draft do not match: draft hidden_size 32 != target "
                       "hidden_size 64"), err


def test_a_speculators_draft_names_its_target(pairs, hub, capsys):
    target, draft = pairs["speculators"]
    cache(hub, "org/spec-target", target, COMMIT_T)
    snapshot = cache(hub, "org/spec-draft", draft, COMMIT_D)
    with pytest.raises(DFlashError, match="names no verifier .*: pass --target"):
        resolve_pair(None, "org/spec-draft")
    config = json.loads((snapshot / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = "org/spec-target"
    (snapshot / "config.json").write_text(json.dumps(config))
    target_dir, draft_dir = resolve_pair(None, "org/spec-draft")
    assert snapshot_origin(target_dir) == {"repo_id": "org/spec-target", "revision": COMMIT_T}
    assert "target org/spec-target: the draft's verifier" in capsys.readouterr().err
    config["speculators_config"]["verifier"]["name_or_path"] = "org/absent-target"
    (snapshot / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match="not in the Hugging Face cache.*the target draft org/spec-draft names"):
        resolve_pair(None, "org/spec-draft")
    _, zlab_draft = pairs["pair"]
    with pytest.raises(DFlashError, match="does not name its target .*: pass --target"):
        resolve_pair(None, zlab_draft)
