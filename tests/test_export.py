"""The exported directory: symbolic axes, shared weights, a valid manifest, atomic writes."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from dflash_onnx.exporter.export import export_pair
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest


def test_graphs_pass_checker_and_keep_dynamic_axes(exported):
    pair = exported("causal_gqa4_b4")
    manifest = load_manifest(pair.out)
    shapes = {t.name: t.shape for t in manifest.target.inputs + manifest.target.outputs}
    assert all(isinstance(d, str) for d in shapes["input_ids"])
    assert all(isinstance(d, str) for d in shapes["past_key_values.0.key"][:2])
    assert shapes["target_hidden"][2] == 2 * pair.spec.hidden_size
    draft = {t.name: t.shape for t in manifest.draft.inputs + manifest.draft.outputs}
    assert isinstance(draft["input_ids"][0], str) and draft["input_ids"][1] == 4
    assert isinstance(draft["target_hidden"][1], str) and isinstance(draft["past_key_values.0.key"][1], str)
    assert draft["logits"][1:] == [3, pair.spec.vocab_size]
    for name in ("target.onnx", "draft.onnx"):
        onnx.checker.check_model(str(pair.out / name))


def test_embedding_and_lm_head_stored_once(exported):
    pair = exported("agree_b8")  # untied: both the embedding and lm_head are shared
    draft = onnx.load(str(pair.out / "draft.onnx"), load_external_data=False)
    vocab = pair.spec.vocab_size
    locations = [{e.key: e.value for e in t.external_data}.get("location")
                 for t in draft.graph.initializer if vocab in t.dims]
    assert locations == ["target.onnx.data"] * 2  # the embedding and the (pre-transposed) lm_head
    own = [t for t in draft.graph.initializer if t.external_data and vocab not in t.dims]
    own_bytes = sum(int({e.key: e.value for e in t.external_data}["length"]) for t in own)
    assert own_bytes <= (pair.out / "draft.onnx.data").stat().st_size < own_bytes + 64 * len(own)


def test_manifest_contents(exported):
    pair = exported("llama_sliding_b16")
    raw = json.loads((pair.out / "dflash.json").read_text())
    for key in ("format_version", "block_size", "target_layer_ids", "mask_token_id", "stop_token_ids", "vocab_size",
                "target_hidden_size", "dtype", "opset", "passes", "sources", "tool_version", "kv_layout"):
        assert key in raw
    assert raw["block_size"] == 16 and raw["model_type"] == "llama"
    assert raw["target"]["num_layers"] == 4 and raw["draft"]["num_layers"] == 3
    assert set(raw["sources"]["draft"]) >= {"config.json", "model.safetensors"}


def test_refuses_existing_out_and_bad_out_dirs(exported, tmp_path):
    pair = exported("agree_b2")
    with pytest.raises(DFlashError, match="already exists"):
        export_pair(pair.target_dir, pair.draft_dir, pair.out, progress=False)
    with pytest.raises(DFlashError, match="not an exported dflash-onnx directory"):
        load_manifest(tmp_path)
    with pytest.raises(DFlashError, match="is not a directory"):
        load_manifest(tmp_path / "missing")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "dflash.json").write_text("{")
    with pytest.raises(DFlashError, match="corrupt"):
        load_manifest(broken)
    (broken / "dflash.json").write_text((pair.out / "dflash.json").read_text())
    with pytest.raises(DFlashError, match="lacks target.onnx"):
        load_manifest(broken)


def test_overwrite_replaces_an_export(exported, tmp_path):
    import shutil

    pair = exported("agree_b2")
    out = tmp_path / "copy"
    shutil.copytree(pair.out, out)
    (out / "stale.txt").write_text("from an older export")
    export_pair(pair.target_dir, pair.draft_dir, out, overwrite=True, progress=False)
    assert not (out / "stale.txt").exists() and load_manifest(out).block_size == 2
    assert [p.name for p in tmp_path.iterdir()] == ["copy"]
    assert oct((out).stat().st_mode & 0o777) != oct(0o700)


def _save_external(model: onnx.ModelProto, path) -> None:
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=f"{path.name}.data", size_threshold=0)


def test_share_initializers_reads_a_pre_transposed_copy_through_transpose(tmp_path):
    """One graph got W [vocab, hidden], the other W^T: the draft keeps no copy of its own."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from dflash_onnx.artifacts.graph_files import share_initializers

    vocab, hidden = 11, 4
    weight = np.random.default_rng(0).normal(size=(vocab, hidden)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, hidden])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, vocab])
    target = helper.make_model(helper.make_graph(
        [helper.make_node("Gemm", ["x", "W"], ["y"], transB=1)], "t", [x], [y],
        [numpy_helper.from_array(weight, "W")]), opset_imports=[helper.make_opsetid("", 18)])
    draft = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "WT"], ["y"])], "d", [x], [y],
        [numpy_helper.from_array(weight.T.copy(), "WT"), numpy_helper.from_array(np.ones(7, np.float32), "own"),
         numpy_helper.from_array(np.ones((vocab, 3), np.float32), "val_9"),  # vocab-sized, the draft's own shape
         numpy_helper.from_array(weight + 1, "stale")]),  # the target's shape, other bytes: stored twice, said
        opset_imports=[helper.make_opsetid("", 18)])
    _save_external(target, tmp_path / "target.onnx")
    _save_external(draft, tmp_path / "draft.onnx")
    feed = {"x": np.arange(hidden, dtype=np.float32)[None]}
    before = ort.InferenceSession(str(tmp_path / "draft.onnx")).run(None, feed)[0]

    shared, unshared = share_initializers(tmp_path, "draft.onnx", "target.onnx", vocab)

    assert shared == {"WT": "W"} and unshared == ["stale"]
    kept = 7 * 4 + vocab * 3 * 4 + weight.nbytes  # `own`, `val_9` and `stale` (aligned), not a copy of W
    assert (tmp_path / "draft.onnx.data").stat().st_size < kept + weight.nbytes
    rewritten = onnx.load(str(tmp_path / "draft.onnx"), load_external_data=False)
    assert rewritten.graph.node[0].op_type == "Transpose"
    after = ort.InferenceSession(str(tmp_path / "draft.onnx")).run(None, feed)[0]
    np.testing.assert_array_equal(before, after)


def _graph(path):
    model = onnx.load(str(path))
    nodes = [(n.op_type, n.domain, list(n.input), list(n.output), [a.SerializeToString() for a in n.attribute])
             for n in model.graph.node]
    return nodes, {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("name", ["causal_gqa4_b4", "agree_b4_fp16", "llama_sliding_b16"])
def test_the_streamed_export_equals_the_loaded_one(name, exported, tmp_path):
    """The default export traces without weights and writes each from the checkpoint (lazy_weights.py); loading
    the pair whole (--no-stream) gives the same graphs, node for node and weight for weight."""
    pair = exported(name)
    export_pair(pair.target_dir, pair.draft_dir, tmp_path / "loaded", dtype=load_manifest(pair.out).dtype,
                progress=False, stream=False)
    for file in ("target.onnx", "draft.onnx"):
        (streamed_nodes, streamed), (loaded_nodes, loaded) = _graph(pair.out / file), _graph(tmp_path / "loaded" / file)
        assert streamed_nodes == loaded_nodes
        assert streamed.keys() == loaded.keys()
        for key, value in loaded.items():
            assert streamed[key].dtype == value.dtype and np.array_equal(streamed[key], value), key


def test_a_pair_built_for_streaming_holds_no_weights(exported):
    from dflash_onnx.exporter.pair import meta_pair

    pair = exported("agree_b8")
    tapped, draft = meta_pair(pair.target_dir, pair.draft_dir, pair.spec.target_layer_ids)
    assert {p.device.type for p in [*tapped.parameters(), *draft.parameters()]} == {"meta"}
    assert float(tapped.lm.model.rotary_emb.inv_freq[1]) > 0  # buffers computed, real


def _rewrite(file, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file))


@pytest.mark.parametrize("where,change,message", [
    ("target", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "target weights .* lack lm.model.layers.1.mlp"),
    ("target", lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:-1]}),
     r"target tensor model.norm.weight .* has shape \(63,\), its config.json implies \(64,\)"),
    ("draft", lambda t: t.update({"extra.weight": t["fc.weight"].clone()}), "draft weights .* have 1 unknown tensors"),
])
def test_the_streamed_export_refuses_a_checkpoint_its_config_does_not_describe(where, change, message, exported,
                                                                               tmp_path):
    import shutil

    pair = exported("agree_b2")
    copy = {kind: shutil.copytree(directory, tmp_path / kind)
            for kind, directory in (("target", pair.target_dir), ("draft", pair.draft_dir))}
    _rewrite(copy[where] / "model.safetensors", change)
    with pytest.raises(DFlashError, match=message):
        export_pair(copy["target"], copy["draft"], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
