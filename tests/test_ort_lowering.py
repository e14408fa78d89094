"""`lower --target ort`: fused, ORT-optimized graphs saved once, same tokens, recorded session options."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import targets.ort as ort_target
from dflash_onnx.cli import main
from dflash_onnx.decode import Decoder
from dflash_onnx.errors import DFlashError
from dflash_onnx.manifest import load_manifest
from targets.ort import OrtOptions, lower_ort


@pytest.fixture(scope="module")
def ort_lowered(exported, tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = tmp_path_factory.mktemp("ort") / name
            lower_ort(exported(name).out, cache[name], progress=False)
        return cache[name]

    return get


@pytest.mark.parametrize("name", ["agree_b8", "causal_gqa4_b4", "llama_sliding_b16"])
def test_lowered_pair_decodes_the_exports_greedy_tokens(name, exported, decoders, ort_lowered):
    lowered = Decoder.open(ort_lowered(name))
    rng = np.random.default_rng(3)
    for _ in range(3):
        prompt = rng.integers(2, 94, size=int(rng.integers(1, 12))).tolist()
        want = decoders(name).generate(prompt, 32, "greedy", stop_token_ids=[]).tokens
        assert lowered.generate(prompt, 32, "dflash", stop_token_ids=[]).tokens == want
        assert lowered.generate(prompt, 32, "greedy", stop_token_ids=[]).tokens == want


def test_manifest_records_the_lowering_and_the_graphs_are_fused(ort_lowered):
    out = ort_lowered("agree_b8")
    manifest = load_manifest(out)
    assert manifest.lowering["target"] == "ort" and manifest.lowering["provider"] == "cpu"
    assert manifest.lowering["session_options"] == {"intra_op_threads": 0, "allow_spinning": True,
                                                    "optimization_level": "extended"}
    assert [p["name"] for p in manifest.passes] == ["rope-fusion", "ort-fusions"]
    assert 0 <= manifest.lowering["max_relative_difference"] <= ort_target.LOWERING_TOLERANCE["float32"]
    target = onnx.load(str(out / "target.onnx"), load_external_data=False)
    ops = {n.op_type for n in target.graph.node}
    assert {"MultiHeadAttention", "RotaryEmbedding", "SkipSimplifiedLayerNormalization"} <= ops
    draft = onnx.load(str(out / "draft.onnx"), load_external_data=False)
    shared = manifest.lowering["shared_with_target"]
    assert shared  # the embedding (and untied lm_head) are read from the target's data file
    locations = {t.name: {e.key: e.value for e in t.external_data}.get("location") for t in draft.graph.initializer}
    assert all(locations[name] == "target.onnx.data" for name in shared if name in locations)
    assert (out / "passes_report.json").is_file() and (out / "tokenizer.json").is_file()


def test_sessions_use_the_recorded_options(exported, tmp_path):
    out = tmp_path / "ort1"
    assert main(["lower", str(exported("agree_b8").out), "--target", "ort", "--out", str(out), "--passes", "none",
                 "--threads", "1", "--spinning", "off", "--quiet"]) == 0
    manifest = load_manifest(out)
    assert manifest.passes == [] and manifest.lowering["options"]["passes"] == []
    decoder = Decoder.open(out)
    options = decoder.target._session.get_session_options()
    assert options.intra_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert decoder.generate([4, 5, 6], 8).tokens == Decoder.open(exported("agree_b8").out).generate([4, 5, 6], 8).tokens


def test_refusals_leave_nothing_behind(exported, ort_lowered, tmp_path, monkeypatch):
    source = exported("agree_b8").out
    with pytest.raises(DFlashError, match="no CUDAExecutionProvider.*onnxruntime-gpu"):
        lower_ort(source, tmp_path / "cuda", OrtOptions(provider="cuda"), progress=False)
    with pytest.raises(DFlashError, match="unknown provider"):
        lower_ort(source, tmp_path / "x", OrtOptions(provider="tpu"), progress=False)
    with pytest.raises(DFlashError, match="already lowered"):
        lower_ort(ort_lowered("agree_b8"), tmp_path / "again", progress=False)
    monkeypatch.setitem(ort_target.LOWERING_TOLERANCE, "float32", -1.0)  # every output now "differs"
    with pytest.raises(DFlashError, match="changes target output"):
        lower_ort(source, tmp_path / "checked", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_cli_lower_ort_errors_are_one_line(exported, tmp_path, capsys):
    assert main(["lower", str(exported("agree_b8").out), "--target", "ort", "--out", str(tmp_path / "o"),
                 "--provider", "cuda", "--quiet"]) == 2
    assert "onnxruntime-gpu" in capsys.readouterr().err
