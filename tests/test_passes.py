"""Graph passes: each keeps parity with the float PyTorch pair within what its rounding moves that pair (a reference
outside the pass: dflash_onnx/exporter/rounded.py) and keeps DFlash lossless on prompts whose answers differ."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest
from passtools import apply_pass, on_ort
from spread import assert_discriminating, varied_prompts

from dflash_onnx.passes.pipeline import apply_pipeline, parse_pass_options
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets import open_decoder

PIPELINES = {"cleanup": ["cleanup"], "rope-fusion": ["rope-fusion"], "int8": ["int8"], "int4": ["int4"],
             "fp16": ["fp16"], "cleanup_rope_int4": ["cleanup", "rope-fusion", "int4"],
             "rope_fp16": ["rope-fusion", "fp16"], "ort-fusions": ["rope-fusion", "ort-fusions"]}
SMALL_BLOCKS = {"*": {"block_size": "16"}}  # the tiny models' matrices are 64 wide
PAIR = "varied_b4"  # its greedy output depends on the whole prompt (tests/spread.py)


@pytest.fixture(scope="session")
def optimized(exported, tmp_path_factory):
    cache = {}

    def get(key: str, options: dict | None = None, pair: str = PAIR):
        if (key, pair) not in cache:
            out = tmp_path_factory.mktemp("passes") / key
            names = PIPELINES.get(key, [key.split("@")[0]])
            source = exported(pair).out
            apply_pipeline(source, names, out, options or SMALL_BLOCKS, progress=False, open_graph=on_ort(source))
            cache[key, pair] = out
        return cache[key, pair]

    return get


def _prompts(seed=0, count=6):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 94, size=int(rng.integers(1, 12))).tolist() for _ in range(count)]


@pytest.mark.parametrize("key", sorted(PIPELINES))
def test_pass_keeps_parity_within_what_its_rounding_moves_and_keeps_dflash_lossless(key, exported, optimized):
    """Logits, features and K/V against the float PyTorch pair: within the export's own float tolerance for the
    exact passes, and within ROUNDING_SLACK times what rounded.py's own rounding moves the pair for the rounding
    ones (not the bound the pass declares); DFlash's tokens equal the transformed graph's greedy tokens on prompts
    whose greedy outputs differ."""
    from dflash_onnx.parity import run_parity

    out = optimized(key)
    manifest = load_manifest(out)
    assert [p["name"] for p in manifest.passes] == PIPELINES[key]
    pair = exported(PAIR)
    report = run_parity(out, pair.target_dir, pair.draft_dir, num_prompts=3, max_new_tokens=16)
    assert report.ok, report.table()
    rounds = any(p.get("lossy") for p in manifest.passes)
    assert any(c.allowed > report.tolerance for c in report.checks if c.allowed is not None) == rounds
    transformed = open_decoder(out)
    prompts = varied_prompts(pair.spec.vocab_size, 6, seed=1)
    greedy = [transformed.generate(p, 24, "greedy", stop_token_ids=[]).tokens for p in prompts]
    assert_discriminating(prompts, greedy, lambda p: transformed.generate(p, 24, "greedy", stop_token_ids=[]).tokens)
    assert [transformed.generate(p, 24, "dflash", stop_token_ids=[]).tokens for p in prompts] == greedy


def test_cleanup_is_exact_enough_to_keep_the_original_tokens(decoders, optimized):
    cleaned, original = open_decoder(optimized("cleanup")), decoders(PAIR)
    for prompt in varied_prompts(original.manifest.vocab_size, 6, seed=2):
        assert cleaned.generate(prompt, 24, "dflash", stop_token_ids=[]).tokens == \
            original.generate(prompt, 24, "greedy", stop_token_ids=[]).tokens


@pytest.mark.parametrize("name", ["varied_b4", "causal_gqa4_b4", "llama_sliding_b16"])
def test_ort_fusions_fuse_norms_rotations_and_attention_and_keep_the_tokens(name, exported, decoders, tmp_path):
    out = tmp_path / "fused"
    apply_pipeline(exported(name).out, ["rope-fusion", "ort-fusions"], out, progress=False)
    manifest = load_manifest(out)
    ops = {g: Counter(n.op_type for n in onnx.load(str(out / getattr(manifest, g).file), load_external_data=False)
                      .graph.node) for g in ("target", "draft")}
    layers = {"target": manifest.target.num_layers, "draft": manifest.draft.num_layers}
    for graph, counts in ops.items():
        assert counts["SimplifiedLayerNormalization"] + counts["SkipSimplifiedLayerNormalization"] >= \
            2 * layers[graph], (graph, counts)
        assert counts["ReduceMean"] == 0 and counts["Pow"] == 0, (graph, counts)
    assert ops["target"]["MultiHeadAttention"] == layers["target"] and ops["target"]["Softmax"] == 0
    assert ops["target"]["RotaryEmbedding"] == 2 * layers["target"] and ops["target"]["GroupQueryAttention"] == 0
    fused, original = open_decoder(out), decoders(name)
    for prompt in varied_prompts(original.manifest.vocab_size, 3, seed=4):
        assert fused.generate(prompt, 24, "dflash", stop_token_ids=[]).tokens == \
            original.generate(prompt, 24, "greedy", stop_token_ids=[]).tokens


def test_quantization_report_and_what_it_leaves_alone(optimized):
    report = json.loads((optimized("int4") / "passes_report.json").read_text())
    target = next(r for r in report if r["graph"] == "target")
    assert target["bytes_after"] < target["bytes_before"] / 2
    assert target["details"]["quantized_matmuls"] >= 4 * 7  # q, k, v, o, gate, up, down per layer
    reasons = " ".join(target["details"]["not_quantized"].values())
    assert "lm_head" in reasons and "not a constant" in reasons  # the RoPE MatMul is never quantized
    model = onnx.load(str(optimized("int4") / "target.onnx"), load_external_data=False)
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == target["details"]["quantized_matmuls"]


def test_the_default_block_is_recorded_in_the_manifest(exported, tmp_path):
    """Blocks of 64 unless asked (ORT's CPU kernel holds 1.25x their int4 bytes; 1.5x at 32), and the manifest
    records the size even when defaulted, so peers (onnxruntime-genai's builder) quantize alike."""
    from dflash_onnx.passes.quantize import BLOCK_SIZE
    from dflash_onnx.runtime.manifest import load_manifest

    out = tmp_path / "int4"
    apply_pipeline(exported("agree_b8").out, ["int4"], out, {}, progress=False)
    recorded = next(p for p in load_manifest(out).passes if p["name"] == "int4")
    assert BLOCK_SIZE == 64 and recorded["options"] == {"block_size": "64"}
    model = onnx.load(str(out / "target.onnx"), load_external_data=False)
    blocks = {a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
              if a.name == "block_size"}
    assert blocks == {64}


def test_lm_head_can_be_quantized_on_request(optimized):
    with_head = optimized("int4@lm_head", {"*": {"block_size": "16"}, "int4": {"lm_head": "true"}})
    plain = json.loads((optimized("int4") / "passes_report.json").read_text())[0]["details"]["quantized_matmuls"]
    report = json.loads((with_head / "passes_report.json").read_text())
    assert report[0]["details"]["quantized_matmuls"] == plain + 1


def test_quantizing_only_the_draft_keeps_fp32_output_and_measures_tau(decoders, optimized):
    """On the pair built to agree, where the float draft's tau is high enough for a loss to show; how far the int4
    draft's logits may move is parity's (a reference-derived bound, tested above)."""
    draft_only = open_decoder(optimized("int4@draft", {"*": {"block_size": "16"}, "int4": {"graphs": "draft"}},
                                        pair="agree_b8"))
    original = decoders("agree_b8")
    taus = {"fp32": [], "int4 draft": []}
    for prompt in _prompts(seed=3, count=8):
        reference = original.generate(prompt, 32, "dflash", stop_token_ids=[])
        quantized = draft_only.generate(prompt, 32, "dflash", stop_token_ids=[])
        assert quantized.tokens == reference.tokens == original.generate(prompt, 32, "greedy", stop_token_ids=[]).tokens
        taus["fp32"].append(reference.tau)
        taus["int4 draft"].append(quantized.tau)
    fp32, quant = np.mean(taus["fp32"]), np.mean(taus["int4 draft"])
    print(f"tau fp32 draft {fp32:.3f}, int4 draft {quant:.3f}")
    assert quant > 1.0  # the quantized draft's blocks are still accepted in part


def test_bad_pass_requests(exported, tmp_path):
    out = exported("agree_b8").out
    with pytest.raises(DFlashError, match="unknown passes"):
        apply_pipeline(out, ["rope-magic"], tmp_path / "a", progress=False)
    with pytest.raises(DFlashError, match="graphs=both2"):
        apply_pipeline(out, ["int4"], tmp_path / "b", {"int4": {"graphs": "both2"}}, progress=False)
    with pytest.raises(DFlashError, match="power of two"):
        apply_pipeline(out, ["int8"], tmp_path / "c", {"*": {"block_size": "24"}}, progress=False)
    with pytest.raises(DFlashError, match="--pass-option int4.block_size='x': give an integer"):
        apply_pipeline(out, ["int4"], tmp_path / "d", {"int4": {"block_size": "x"}}, progress=False)
    # a lowering's own rewrites change the graph form the manifest describes: only that lowering applies them
    with pytest.raises(DFlashError, match="kv-buffer: applied by 'dflash-onnx lower --target ort'"):
        apply_pipeline(out, ["cleanup", "kv-buffer"], tmp_path / "e", progress=False)
    with pytest.raises(DFlashError, match="kv-buffer.ctx_len=None: give an integer \\(required\\)"):
        apply_pipeline(out, ["rope-fusion", "ort-fusions", "kv-buffer"], tmp_path / "f", progress=False,
                       lowering="ort")
    with pytest.raises(DFlashError, match="NAME.KEY=VALUE"):
        parse_pass_options(["nonsense"])
    assert parse_pass_options(["int4.block_size=64", "symmetric=false"]) == {
        "int4": {"block_size": "64"}, "*": {"symmetric": "false"}}
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_optimize_command(exported, tmp_path, capsys):
    from dflash_onnx.cli import main

    out = tmp_path / "opt"
    assert main(["optimize", str(exported("agree_b2").out), "--passes", "cleanup,int8", "--out", str(out),
                 "--pass-option", "block_size=16", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "passes: cleanup, int8" in printed and "MiB on disk" in printed and (out / "passes_report.json").is_file()
    assert main(["generate", str(out), "--prompt-ids", "3,4", "--max-new-tokens", "5", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 5


def test_parity_refuses_a_rounding_coarser_than_the_manifest_records(exported, optimized, tmp_path):
    """int4 bytes under an int8 record: the reference rounds 16x finer than the graph did, so parity must fail on
    the logits (its bound follows the recorded rounding, not anything the graph says of itself)."""
    import shutil

    from dflash_onnx.parity import run_parity

    pair, out = exported(PAIR), tmp_path / "int4-as-int8"
    shutil.copytree(optimized("int4"), out)
    manifest = load_manifest(out)
    manifest.passes = [{**p, "name": "int8"} if p["name"] == "int4" else p for p in manifest.passes]
    manifest.save(out)
    report = run_parity(out, pair.target_dir, pair.draft_dir, num_prompts=2, max_new_tokens=12)
    failed = {c.name for c in report.checks if not c.ok}
    assert "target logits (verify)" in failed and "target logits (prefill)" in failed, report.table()
    assert not any(name.startswith("tokens") for name in failed)  # still lossless: only the bound was wrong


def test_export_with_passes(exported, tmp_path, capsys):
    from dflash_onnx.cli import main

    pair = exported("agree_b2")
    out = tmp_path / "exported"
    assert main(["export", "--target", str(pair.target_dir), "--draft", str(pair.draft_dir), "--out", str(out),
                 "--passes", "cleanup", "--quiet"]) == 0
    assert [p["name"] for p in load_manifest(out).passes] == ["cleanup"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]  # the staging export is gone


def test_steps_measures_directories_side_by_side(exported, optimized, capsys):
    from dflash_onnx.cli import main

    original, quantized = exported(PAIR).out, optimized("int8")
    assert main(["steps", str(original), str(quantized), "--context", "16", "--repeats", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["passes"] for r in rows] == [[], ["int8"]]
    assert all(r["decode_ms"] > 0 and r["verify_ms"] > 0 and r["draft_ms"] > 0 for r in rows)
    assert rows[1]["size_mib"] < rows[0]["size_mib"]


def test_weight_transposes_are_folded_so_tied_heads_can_be_quantized():
    """A tied lm_head exports as MatMul(x, Transpose(embedding)): int4 must still see a constant weight."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from dflash_onnx.passes.quantize import int4

    embedding = np.random.default_rng(0).normal(size=(40, 32)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("Transpose", ["E"], ["ET"], perm=[1, 0]),
         helper.make_node("MatMul", ["h", "ET"], ["logits"], name="lm_head")], "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3, 40])],
        [numpy_helper.from_array(embedding, "E")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    feeds = {"ids": np.array([[1, 5, 9]])}
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    out, details = apply_pass(int4, model, options={"block_size": "16", "lm_head": "true"}, vocab_size=40)
    assert details["folded_weight_transposes"] == 1 and details["quantized_matmuls"] == 1
    assert not any(n.op_type == "Transpose" for n in out.graph.node)
    got = ort.InferenceSession(out.SerializeToString()).run(None, feeds)[0]
    assert np.abs(got - want).max() <= 0.75 * np.abs(want).max()


def test_a_weight_kept_in_float_is_not_folded_into_a_second_copy():
    from onnx import TensorProto, helper, numpy_helper

    from dflash_onnx.passes.quantize import int4

    embedding = np.ones((40, 32), np.float32)
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["E"], ["ET"], perm=[1, 0]), helper.make_node("MatMul", ["h", "ET"], ["y"])],
        "tied", [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 40])], [numpy_helper.from_array(embedding, "E")])
    out, details = apply_pass(int4, helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
                              options={"block_size": "16"}, vocab_size=40)
    assert details["folded_weight_transposes"] == 0 and len(out.graph.initializer) == 1


def _fc_then_norm_graph(fc_gain: float):
    """target_hidden -> fc MatMul -> RMSNorm -> MatMul -> logits: the head of a draft, fc scaled by fc_gain."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = {"fc": rng.normal(size=(24, 8)) * fc_gain, "norm": np.ones(8), "head": rng.normal(size=(8, 5)),
               "two": np.array(2.0), "eps": np.array(1e-6)}
    nodes = [helper.make_node("MatMul", ["target_hidden", "fc"], ["fc_out"]),
             helper.make_node("Pow", ["fc_out", "two"], ["squared"]),
             helper.make_node("ReduceMean", ["squared"], ["mean"], axes=[-1], keepdims=1),
             helper.make_node("Add", ["mean", "eps"], ["mean_eps"]), helper.make_node("Sqrt", ["mean_eps"], ["rms"]),
             helper.make_node("Reciprocal", ["rms"], ["inv"]), helper.make_node("Mul", ["fc_out", "inv"], ["normed"]),
             helper.make_node("Mul", ["normed", "norm"], ["hidden"]),
             helper.make_node("MatMul", ["hidden", "head"], ["logits"])]
    graph = helper.make_graph(
        nodes, "draft_head", [helper.make_tensor_value_info("target_hidden", TensorProto.FLOAT, [1, "seq", 24])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "seq", 5])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    feeds = [{"target_hidden": np.random.default_rng(s).normal(size=(1, 6, 24)).astype(np.float32) * 10}
             for s in range(3)]
    return model, feeds


def _run_graph(model, feeds):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]


def test_fp16_prescales_the_draft_fc_so_its_output_fits_float16():
    from dflash_onnx.passes.fp16 import run as fp16

    model, feeds = _fc_then_norm_graph(fc_gain=3000.0)  # fc outputs reach ~1e5: beyond float16
    want = _run_graph(model, feeds[0])
    original_fc = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "fc"))
    scaled, details = apply_pass(fp16, model, "draft", feeds=feeds)
    assert details["fc_output_peak"] > 65504 and details["fc_scale"] >= details["fc_output_peak"] / 128
    assert np.log2(details["fc_scale"]).is_integer() and not details["fp16_overflow"]
    fc = onnx.numpy_helper.to_array(next(t for t in scaled.graph.initializer if t.name == "fc"))
    np.testing.assert_allclose(fc.astype(np.float32), original_fc / details["fc_scale"], rtol=1e-3)
    got = _run_graph(scaled, feeds[0])
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()  # RMSNorm made the scale invisible


def test_fp16_reports_activations_beyond_float16(tmp_path):
    from dflash_onnx.passes.fp16 import run as fp16

    model, feeds = _fc_then_norm_graph(fc_gain=3000.0)
    _, details = apply_pass(fp16, model, feeds=feeds)  # only the draft's fc is pre-scaled
    # float32 islands (the square) may exceed float16's range; fc's own output may not
    assert details["fp16_overflow"] and details["largest_activation_at"] == "fc_out"
    assert "exceeds float16's range" in details["warnings"][0]
    _, quiet = apply_pass(fp16, _fc_then_norm_graph(fc_gain=1.0)[0], feeds=feeds)
    assert not quiet["fp16_overflow"] and "warnings" not in quiet


def test_fp16_pass_calibrates_on_decoding_inputs(optimized):
    report = {r["graph"]: r["details"] for r in json.loads((optimized("fp16") / "passes_report.json").read_text())}
    assert report["draft"]["fc_scale"] >= 1 and report["draft"]["fc_output_peak"] > 0
    for graph in ("target", "draft"):
        assert 0 < report[graph]["largest_activation"] < 65504 and not report[graph]["fp16_overflow"]
    assert report["target"]["mask_sentinels"] > 0  # attention masks are set aside, not reported as overflow


def test_fp16_keeps_rope_angles_in_float32(optimized):
    """Angles reach ctx_len radians: in float16 a position near 4096 would be rounded to a multiple of 4."""
    for graph in ("target", "draft"):
        model = onnx.load(str(optimized("fp16") / f"{graph}.onnx"), load_external_data=False)
        producers = {o: n for n in model.graph.node for o in n.output}
        pending, seen = [n for n in model.graph.node if n.op_type in ("Cos", "Sin")], set()
        assert pending
        while pending:
            node = pending.pop()
            assert not (node.op_type == "Cast" and onnx.helper.get_attribute_value(node.attribute[0]) ==
                        onnx.TensorProto.FLOAT16), f"{graph}: {node.name} casts RoPE angles to float16"
            for name in node.input:
                if name in producers and name not in seen:
                    seen.add(name)
                    pending.append(producers[name])


def test_fp16_islands_are_not_squeezed_through_float16_between_them(optimized):
    """ORT's converter casts each blocked node's output to float16 and back before the next blocked node."""
    for graph in ("target", "draft"):
        model = onnx.load(str(optimized("fp16") / f"{graph}.onnx"), load_external_data=False)
        producers = {o: n for n in model.graph.node for o in n.output}
        for node in model.graph.node:
            source = producers.get(node.input[0]) if node.op_type == "Cast" else None
            if source is not None and source.op_type == "Cast":
                widths = [onnx.helper.get_attribute_value(n.attribute[0]) for n in (source, node)]
                assert widths != [onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT], (graph, node.name)
        pow_node = next(n for n in model.graph.node if n.op_type == "Pow")
        reader = next(n for n in model.graph.node if pow_node.output[0] in n.input)
        assert reader.op_type == "ReduceMean"  # the squares go straight into the mean, in float32


@pytest.mark.parametrize("name,options", [("agree_b8", {"block_size": "16", "lm_head": "true"}),
                                          ("causal_gqa4_b4", {"block_size": "16", "lm_head": "true"}),
                                          ("agree_b4_fp16", {"symmetric": "false", "accuracy_level": "0"})])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_tensor_by_tensor_equals_ort_quantizing_the_whole_model(name, options, bits, exported,
                                                                           monkeypatch):
    """The pass's lazy per-tensor quantization makes what ONNX Runtime's MatMulNBitsQuantizer makes of the whole
    graph (after folding weight transposes, as the pass does): the same nodes, names and quantized bytes, with
    the columns quantized 24 at a time (the last chunk ragged)."""
    from onnx import numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from dflash_onnx.passes import quantize
    from dflash_onnx.passes.quantize import BLOCK_SIZE, int4, int8

    monkeypatch.setattr(quantize, "COLUMNS", 24)

    pair = exported(name)
    for graph in ("target", "draft"):
        model = onnx.load(str(pair.out / f"{graph}.onnx"))
        ours, details = apply_pass(int4 if bits == 4 else int8, model, graph, options, vocab_size=pair.spec.vocab_size)
        block = int(options.get("block_size", BLOCK_SIZE))
        oracle = _ort_quantized(model, bits, block, options, pair.spec.vocab_size, MatMulNBitsQuantizer)
        assert [(n.op_type, list(n.input), list(n.output), n.name) for n in ours.graph.node] == \
            [(n.op_type, list(n.input), list(n.output), n.name) for n in oracle.graph.node]
        assert [sorted((a.name, onnx.helper.get_attribute_value(a)) for a in n.attribute) for n in ours.graph.node] == \
            [sorted((a.name, onnx.helper.get_attribute_value(a)) for a in n.attribute) for n in oracle.graph.node]
        want = {t.name: numpy_helper.to_array(t) for t in oracle.graph.initializer}
        got = {t.name: numpy_helper.to_array(t) for t in ours.graph.initializer}
        assert got.keys() == want.keys() and details["quantized_matmuls"] > 0
        for key, value in want.items():
            assert got[key].dtype == value.dtype and np.array_equal(got[key], value), key


def _ort_quantized(model, bits, block, options, vocab, quantizer_class):
    """The oracle: transposed weights folded as float initializers `{name}.transposed`, then ORT's quantizer
    on the whole model, the same MatMuls excluded, unused nodes and initializers dropped."""
    from onnx import numpy_helper

    model = onnx.ModelProto.FromString(model.SerializeToString())
    weights = {t.name: t for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    keep_head = options.get("lm_head") != "true"
    excluded = []
    for index, node in enumerate(model.graph.node):
        if node.op_type != "MatMul":
            continue
        node.name = node.name or f"MatMul_{index}"
        source = producers.get(node.input[1])
        if source is not None and source.op_type == "Transpose" and source.input[0] in weights:
            name = f"{source.input[0]}.transposed"
            if name not in weights and not (keep_head and vocab in weights[source.input[0]].dims):
                weights[name] = numpy_helper.from_array(numpy_helper.to_array(weights[source.input[0]]).T.copy(), name)
                model.graph.initializer.append(weights[name])
            node.input[1] = name if name in weights else node.input[1]
        weight = weights.get(node.input[1])
        if weight is None or len(weight.dims) != 2 or weight.dims[0] < block or (keep_head and vocab in weight.dims):
            excluded.append(node.name)
    quantizer = quantizer_class(model, bits=bits, block_size=block, is_symmetric=options.get("symmetric") != "false",
                                accuracy_level=int(options.get("accuracy_level", 4)) or None,
                                nodes_to_exclude=excluded)
    quantizer.process()
    out = quantizer.model.model
    while True:
        used = {i for n in out.graph.node for i in n.input} | {o.name for o in out.graph.output}
        dead = [n for n in out.graph.node if not any(o in used for o in n.output)]
        for node in dead:
            out.graph.node.remove(node)
        if not dead:
            break
    used = {i for n in out.graph.node for i in n.input}
    kept = [t for t in out.graph.initializer if t.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    return out


def test_the_free_space_check_expects_what_the_passes_write(exported, tmp_path, monkeypatch):
    """int4 writes 4-bit weights: a disk with 0.6x the export's bytes free takes it, and a pass that rewrites the
    graphs at their size is refused (the int4 of the 40 GiB gpt-oss-20b-shaped export was refused for 43 GiB)."""
    import collections
    import shutil

    source = exported("agree_b8").out
    source_bytes = sum(p.stat().st_size for p in source.glob("*.onnx*"))
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * source_bytes, 0, int(0.6 * source_bytes)))
    apply_pipeline(source, ["int4"], tmp_path / "int4", progress=False)
    assert sum(p.stat().st_size for p in (tmp_path / "int4").glob("*.onnx*")) < 0.6 * source_bytes
    with pytest.raises(DFlashError, match="free some space"):
        apply_pipeline(source, ["cleanup"], tmp_path / "cleanup", progress=False)
    assert not (tmp_path / "cleanup").exists()


def test_sibling_matmuls_compute_every_column_as_the_separate_matmuls_did():
    """Three int4 MatMulNBits on one activation (and one on another) -> one fused call and a Split; outputs equal
    bit for bit at 1, 2 and 16 rows; the odd one out is left alone."""
    import onnx_ir as ir
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from dflash_onnx.passes.sibling_matmuls import run

    rng = np.random.default_rng(0)
    k, block, nodes, inits, outputs = 64, 16, [], [], []
    for index, (source, n) in enumerate([("A", 32), ("A", 16), ("A", 48), ("C", 16)]):
        packed = rng.integers(0, 255, (n, k // block, block // 2), dtype=np.uint8)
        inits += [numpy_helper.from_array(packed, f"B{index}"),
                  numpy_helper.from_array(rng.random(n * k // block).astype(np.float32), f"S{index}")]
        nodes.append(helper.make_node("MatMulNBits", [source, f"B{index}", f"S{index}"], [f"Y{index}"],
                                      domain="com.microsoft", K=k, N=n, bits=4, block_size=block, accuracy_level=4))
        outputs.append(helper.make_tensor_value_info(f"Y{index}", TensorProto.FLOAT, ["M", n]))
    nodes += [helper.make_node("Relu", [f"Y{i}"], [f"R{i}"]) for i in range(4)]  # projections are read, not returned
    inputs = [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", k]) for x in "AC"]
    returned = [helper.make_tensor_value_info(f"R{i}", TensorProto.FLOAT, ["M", f"N{i}"]) for i in range(4)]
    graph = helper.make_graph(nodes, "g", inputs, returned, inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    proto = helper.make_model(graph, opset_imports=opsets)
    fused, details = run(ir.from_proto(proto), None)
    assert details == {"matmuls_fused": 3}
    ops = [node.op_type for node in fused.graph]
    assert ops.count("MatMulNBits") == 2 and ops.count("Split") == 1
    before = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    after = ort.InferenceSession(ir.to_proto(fused).SerializeToString(), providers=["CPUExecutionProvider"])
    for rows in (1, 2, 16):
        feeds = {x: rng.standard_normal((rows, k)).astype(np.float32) for x in "AC"}
        for want, got in zip(before.run(None, feeds), after.run(None, feeds)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bits", [4, 8])
def test_matmulnbits_bytes_decode_to_the_float_weights_within_half_a_step(bits, exported, optimized):
    """Read as MatMulNBits documents its input B (per output column, blocks along K, two 4-bit values a byte low
    nibble first, zero point 8 or 128 when none is given), plain numpy gets back every float weight within half of
    its block's step (a whole step at the top level, 7 or 127: the block's largest magnitude takes the bottom one,
    -8 or -128, so the other sign's can be cut off there), independent of ORT's kernels."""
    from onnx import numpy_helper

    source = onnx.load(str(exported(PAIR).out / "target.onnx"))
    floats = {t.name: numpy_helper.to_array(t) for t in source.graph.initializer}
    quantized = onnx.load(str(optimized(f"int{bits}") / "target.onnx"))
    stored = {t.name: numpy_helper.to_array(t) for t in quantized.graph.initializer}
    checked = 0
    for node in quantized.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attributes = {a.name: a.i for a in node.attribute}
        packed, scales = stored[node.input[1]], stored[node.input[2]]
        assert len(node.input) < 4 or not node.input[3], "symmetric by default: no zero points"
        if bits == 4:
            levels = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1).astype(int) - 8
        else:
            levels = packed.reshape(packed.shape[0], -1).astype(int) - 128
        step = np.repeat(np.abs(scales), attributes["block_size"], axis=-1)[:, :attributes["K"]]
        weight = (levels[:, :attributes["K"]] * np.repeat(scales, attributes["block_size"], -1)[:, :attributes["K"]]).T
        name = node.input[1].removesuffix(f"_Q{bits}")
        original = floats[name.removesuffix(".transposed")]
        original = original.T if name.endswith(".transposed") else original
        assert weight.shape == original.shape, name
        allowed = np.where(levels[:, :attributes["K"]] == 2 ** (bits - 1) - 1, step, step / 2).T
        assert np.all(np.abs(weight - original) <= allowed * (1 + 1e-5) + 1e-9), name
        checked += 1
    assert checked >= 4 * 7  # q, k, v, o, gate, up, down in each of the 4 layers
