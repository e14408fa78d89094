"""AI 100 lowering: the compiler inputs are consistent, and the exact graphs decode losslessly (ORT emulation)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest
import torch
from reference import (  # skips the module when the oracle is missing
    DFlashDraftModel,
    dflash_model,
)
from transformers import AutoModelForCausalLM

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.runtime.sampling import SamplingParams
from dflash_onnx.targets import LowerRequest, open_decoder
from dflash_onnx.targets.ai100.lower import lower_ai100
from dflash_onnx.targets.ai100.options import Ai100Options


def _prompts(count, vocab, seed):
    rng = np.random.default_rng(seed)
    lengths = [1, 3, 15, 16, 17, 40] + [int(rng.integers(1, 30)) for _ in range(count - 6)]
    return [rng.integers(2, vocab - 1, size=n).tolist() for n in lengths]


def test_ai100_graphs_equal_reference_and_the_ort_form(exported, lowered, decoders):
    pair, (directory, _) = exported("agree_b8"), lowered("agree_b8")
    ai100, ort_form = open_decoder(directory), decoders("agree_b8")
    target = AutoModelForCausalLM.from_pretrained(str(pair.target_dir), attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(str(pair.draft_dir)).eval()
    lengths = []
    for prompt in _prompts(12, pair.spec.vocab_size, seed=4):  # up to 40 tokens: chunked prefill and ingest
        ours = ai100.generate(prompt, 40, "dflash", stop_token_ids=[])
        ref = dflash_model.dflash_generate(draft, target, torch.tensor(prompt)[None], 40, None)
        assert ours.tokens == ref[0, len(prompt):].tolist()
        twin = ort_form.generate(prompt, 40, "dflash", stop_token_ids=[])
        assert (ours.tokens, ours.acceptance_lengths) == (twin.tokens, twin.acceptance_lengths)
        assert ai100.generate(prompt, 40, "greedy", stop_token_ids=[]).tokens == ours.tokens
        lengths += ours.acceptance_lengths
    assert max(lengths) == 8 and min(lengths) == 1


def test_ai100_stop_tokens_and_sampling(exported, lowered):
    pair, (directory, _) = exported("agree_b8"), lowered("agree_b8")
    decoder = open_decoder(directory)
    favourite = pair.spec.favourite_token
    stopped = decoder.generate([3, 4, 5], 30, "dflash", stop_token_ids=[favourite])
    assert stopped.tokens[-1] == favourite and favourite not in stopped.tokens[:-1]
    with pytest.raises(DFlashError, match="return token ids only .* lower again with --logits"):
        decoder.generate([3, 4, 5], 30, "dflash", SamplingParams(0.8, 0.9, 20, seed=1))
    sampler = open_decoder(lowered("agree_b2")[0])  # lowered with --logits
    assert "logits" in load_manifest(lowered("agree_b2")[0]).target.output_names()
    sampled = sampler.generate([3, 4, 5], 30, "dflash", SamplingParams(0.8, 0.9, 20, seed=1), stop_token_ids=[])
    again = sampler.generate([3, 4, 5], 30, "dflash", SamplingParams(0.8, 0.9, 20, seed=1), stop_token_ids=[])
    assert sampled.tokens == again.tokens and len(sampled.tokens) == 30


def test_ai100_fp16_weights_stay_lossless(lowered):
    directory, _ = lowered("agree_b4_fp16")
    decoder = open_decoder(directory)
    assert load_manifest(directory).dtype == "float16"
    for prompt in ([5], [9, 8, 7, 6, 5, 4, 3, 2, 11, 12], list(range(2, 30))):
        dflash = decoder.generate(prompt, 24, "dflash", stop_token_ids=[])
        assert dflash.tokens == decoder.generate(prompt, 24, "greedy", stop_token_ids=[]).tokens


def _dims(model: onnx.ModelProto) -> dict[str, list]:
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(model.graph.input) + list(model.graph.output)}


@pytest.mark.parametrize("graph", ["target", "draft"])
def test_specializations_retained_pairs_and_custom_io_match_the_graphs(lowered, graph):
    directory, _ = lowered("agree_b8")
    manifest = load_manifest(directory)
    model = onnx.load(str(directory / f"{graph}.onnx"), load_external_data=False)
    dims = _dims(model)
    symbols = {d for shape in dims.values() for d in shape if isinstance(d, str)}
    assert symbols == {"batch_size", "seq_len", "ctx_len", "comp_ctx_lengths"}
    named = json.loads((directory / f"{graph}_specializations.json").read_text())["specializations"]
    flat = json.loads((directory / f"{graph}_specializations_flat.json").read_text())["specializations"]
    assert [spec["symbols"] for spec in named] == flat  # the same sizes for SDKs without named specializations
    for spec in flat:
        assert set(spec) == symbols and all(isinstance(v, str) for v in spec.values())
        assert spec["ctx_len"] == str(manifest.ctx_len)
    sizes = sorted((int(s["seq_len"]), int(s["comp_ctx_lengths"])) for s in flat)
    assert sizes == sorted((n, c) for n in (manifest.block_size, manifest.prefill_len) for c in (64, 160))
    assert len({spec["name"] for spec in named}) == len(named)
    assert manifest.lowering.compute_context_lengths == [64, 160]
    past = [n for n in dims if n.startswith("past_") and not n.endswith("_RetainedState")]
    assert past and all(dims[f"{n}_RetainedState"] == dims[n] for n in past)
    assert all(dims[n][2] == "ctx_len" for n in past)
    custom_io = (directory / f"{graph}_custom_io.yaml").read_text()
    for name in past:  # QEfficient's layout, MXINT8 K/V by default
        assert f" - IOName: {name}\n   Precision: mxint8\n" in custom_io
        assert f" - IOName: {name}_RetainedState\n   Precision: mxint8\n" in custom_io


@pytest.mark.parametrize("graph", ["target", "draft"])
def test_graphs_use_standard_ops_rotary_tables_and_emit_ids(lowered, graph):
    directory, _ = lowered("agree_b8")
    model = onnx.load(str(directory / f"{graph}.onnx"), load_external_data=False)
    assert {n.domain for n in model.graph.node} <= {""}
    assert {o.domain: o.version for o in model.opset_import}.get("") == 18
    onnx.checker.check_model(str(directory / f"{graph}.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("ScatterND") >= 2 and "ArgMax" in ops  # greedy ids computed on the device
    assert "Cos" not in ops and "Sin" not in ops  # rotary cos/sin gathered from tables, no in-graph angles
    outputs = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    ids = "greedy_ids" if graph == "target" else "draft_ids"
    assert outputs[ids] == onnx.TensorProto.INT32 and "logits" not in outputs  # greedy graphs: no logits
    with_logits = onnx.load(str(lowered("agree_b2")[0] / f"{graph}.onnx"), load_external_data=False)
    assert "logits" in {o.name for o in with_logits.graph.output}


def test_missing_compiler_writes_compile_sh_and_says_so(exported, tmp_path, monkeypatch):
    import dflash_onnx.targets.ai100.lower as ai100

    pair = exported("agree_b2")
    monkeypatch.setattr(ai100, "find_compiler", lambda: None)
    with pytest.raises(DFlashError, match="qaic-compile not found.*compile.sh.*--dry-run"):
        lower_ai100(pair.out, tmp_path / "ai", Ai100Options(ctx_len=64, prefill_len=4), LowerRequest(progress=False))
    script = (tmp_path / "ai" / "compile.sh").read_text()
    assert script.count("\ncompile target ") == 1 and script.count("\ncompile draft ") == 1


def test_ai100_backend_needs_the_sdk_and_a_lowering(lowered, exported):
    directory, _ = lowered("agree_b8")
    with pytest.raises(DFlashError, match="needs the Cloud AI 100 platform and apps SDKs"):
        open_decoder(directory, backend="ai100")
    with pytest.raises(DFlashError, match="not a Cloud AI 100 lowering: run 'dflash-onnx lower OUT --target ai100"):
        open_decoder(exported("agree_b8").out, backend="ai100")


def test_context_beyond_ctx_len_is_refused(lowered):
    decoder = open_decoder(lowered("agree_b8")[0])
    with pytest.raises(DFlashError, match="ctx-len"):
        decoder.generate(list(range(2, 90)), 100, "dflash", stop_token_ids=[])


@pytest.mark.parametrize("options,message", [
    (Ai100Options(prefill_len=12), "multiple of the block size 8"),
    (Ai100Options(prefill_len=8), "larger than it"),
    (Ai100Options(ctx_len=16, prefill_len=16), "must exceed --prefill-len"),
    (Ai100Options(kv_dtype="int4"), "--kv-dtype int4"),
    (Ai100Options(opset=17), "opset 18"),
])
def test_bad_lowering_options(exported, tmp_path, options, message):
    with pytest.raises(DFlashError, match=message):
        lower_ai100(exported("agree_b8").out, tmp_path / "x", dataclasses.replace(options, dry_run=True),
                    LowerRequest(progress=False))
    assert not (tmp_path / "x").exists()


def test_fp16_calibration_scales_fc_and_reports_the_largest_activation(exported):
    from dflash_onnx.exporter.models.target import TappedTarget
    from dflash_onnx.exporter.pair import load_draft, load_target
    from dflash_onnx.targets.fp16_calibration import calibrate_fc_scale

    pair = exported("agree_b2")
    lm = load_target(pair.target_dir)
    draft = load_draft(pair.draft_dir, lm)
    tapped = TappedTarget(lm, draft.spec.target_layer_ids)
    plain = calibrate_fc_scale(tapped, draft, 96, 95, 2, prompts=1, length=8)
    assert plain["fc_scale"] == 1.0 and not plain["fp16_overflow"] and plain["largest_activation_at"]
    with torch.no_grad():
        draft.fc.weight.mul_(1e5)  # fc output far outside float16's safe range for RMSNorm
    scaled = calibrate_fc_scale(tapped, draft, 96, 95, 2, prompts=1, length=8)
    assert scaled["fc_output_peak"] / scaled["fc_scale"] <= 128 < scaled["fc_output_peak"]
    assert scaled["largest_activation_at"].startswith("draft.fc")


def test_scaled_fc_leaves_the_context_unchanged(exported):
    from dflash_onnx.exporter.models.retained import RetainedTarget
    from dflash_onnx.exporter.models.target import TappedTarget
    from dflash_onnx.exporter.pair import load_draft, load_target

    pair = exported("agree_b2")
    lm = load_target(pair.target_dir)
    draft = load_draft(pair.draft_dir, lm)
    tapped = TappedTarget(lm, draft.spec.target_layer_ids)
    ids, positions, read = torch.tensor([[3, 4, 5]]), torch.arange(3)[None], torch.zeros(8, dtype=torch.int64)
    buffers = [torch.zeros(1, 2, 8, 16) for _ in range(8)]
    with torch.no_grad():
        draft.fc.weight.mul_(1e4)  # outputs in the hundreds, where a scale is chosen (eps is then negligible)
        plain = RetainedTarget(tapped, draft, 1.0, 8)(ids, positions, read, *buffers)[1]
        scaled = RetainedTarget(tapped, draft, 64.0, 8)(ids, positions, read, *buffers)[1]
    torch.testing.assert_close(scaled, plain, atol=1e-4, rtol=1e-3)


def test_padded_rows_write_only_the_scratch_slot(lowered):
    """A verify call padded from 3 real rows to the block: only slots 5..7 and the scratch slot change."""
    import onnxruntime as ort

    directory, _ = lowered("agree_b8")
    manifest = load_manifest(directory)
    session = ort.InferenceSession(str(directory / "target.onnx"))
    graph = manifest.target
    rng = np.random.default_rng(0)
    buffers = {name: rng.normal(size=(1, graph.num_kv_heads, manifest.ctx_len, graph.head_dim)).astype(np.float32)
               for name in graph.kv_inputs}
    positions = np.array([[5, 6, 7] + [manifest.ctx_len - 1] * 5])
    out = dict(zip(graph.kv_outputs, session.run(graph.kv_outputs, {
        "input_ids": np.array([[3, 4, 5, 0, 0, 0, 0, 0]]), "position_ids": positions,
        "comp_ctx_lengths": np.zeros(64, np.int64), **buffers})))
    for name, retained in zip(graph.kv_inputs, graph.kv_outputs):
        changed = np.flatnonzero((out[retained] != buffers[name]).any(axis=(0, 1, 3)))
        assert set(changed) <= {5, 6, 7, manifest.ctx_len - 1} and {5, 6, 7} <= set(changed)


def test_parity_refuses_a_lowered_directory(exported, lowered):
    from dflash_onnx.parity import run_parity

    pair = exported("agree_b8")
    with pytest.raises(DFlashError, match="lowered \\(for ai100, retained form\\): run parity on the export"):
        run_parity(lowered("agree_b8")[0], pair.target_dir, pair.draft_dir, num_prompts=1)


def _graph(path):
    model = onnx.load(str(path))
    nodes = [(n.op_type, list(n.input), list(n.output), [a.SerializeToString() for a in n.attribute])
             for n in model.graph.node]
    return nodes, {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("name", ["causal_gqa4_b4", "agree_b4_fp16"])  # tied float32 / untied float16
def test_the_streamed_calibration_and_retained_export_equal_the_loaded_ones(name, exported, tmp_path):
    """The lowering runs the calibration on a meta pair whose modules read their weights when called, and writes
    each weight from its checkpoint (fc divided by its scale) as the graphs are saved: same numbers, same graphs
    as with the pair loaded whole (--no-stream)."""
    from dflash_onnx.exporter.lazy_weights import pair_sources, weights_on_demand
    from dflash_onnx.exporter.pair import DTYPES, load_tapped_pair, meta_pair
    from dflash_onnx.targets.ai100.lower import export_retained
    from dflash_onnx.targets.fp16_calibration import calibrate_fc_scale

    pair = exported(name)
    manifest = load_manifest(pair.out)
    ids = manifest.target_layer_ids
    args = (manifest.vocab_size, manifest.mask_token_id, manifest.block_size)
    loaded = load_tapped_pair(pair.target_dir, pair.draft_dir, ids, manifest.dtype)
    meta = meta_pair(pair.target_dir, pair.draft_dir, ids, manifest.dtype)
    sources = pair_sources(*meta, pair.target_dir, pair.draft_dir)
    with weights_on_demand(list(meta), sources, DTYPES[manifest.dtype]):
        streamed = calibrate_fc_scale(*meta, *args, prompts=2, length=12)
    assert streamed == calibrate_fc_scale(*loaded, *args, prompts=2, length=12)
    assert {p.device.type for module in meta for p in module.parameters()} == {"meta"}  # dropped after each call
    if manifest.dtype != "float32":
        return  # the float16 graphs' export is the float32 one's with float16 weights: one export comparison suffices
    options = Ai100Options(ctx_len=64, prefill_len=4 * manifest.block_size)
    export_retained(*loaded, manifest, options, (tmp_path / "loaded").mkdir() or tmp_path / "loaded", 4.0)
    export_retained(*meta, manifest, options, (tmp_path / "streamed").mkdir() or tmp_path / "streamed", 4.0, sources)
    for file in ("target.onnx", "draft.onnx"):
        (want_nodes, want), (got_nodes, got) = _graph(tmp_path / "loaded" / file), _graph(tmp_path / "streamed" / file)
        assert got_nodes == want_nodes
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key].dtype == value.dtype and np.array_equal(got[key], value), key  # fc's scale included
