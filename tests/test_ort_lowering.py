"""`lower --target ort`: fused, ORT-optimized graphs saved once, same tokens, recorded session options."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from conftest import KV_BUFFER, VARIED, CopiedWhenBound
from spread import assert_discriminating, varied_prompts

import dflash_onnx.targets.ort.check as ort_check
from dflash_onnx.cli import main
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets import LowerRequest, open_decoder
from dflash_onnx.targets.ort.lower import lower_ort
from dflash_onnx.targets.ort.options import OrtOptions
from dflash_onnx.targets.ort.session import OrtBufferSession

QUIET = LowerRequest(progress=False)
REWRITES = ["draft-attention", "rope-cache", "kv-buffer", "draft-rows", "tidy"]  # the lowering's own, in order


def _rewrote(manifest, name: str, graph: str, key: str) -> int:
    """What the lowering's rewrite `name` reports for `graph` (0 when it did not run)."""
    return manifest.lowering.rewrites.get(name, {}).get(graph, {}).get(key, 0)



@pytest.mark.parametrize("name", sorted(KV_BUFFER))
def test_lowered_pair_decodes_the_exports_greedy_tokens(name, exported, decoders, ort_lowered):
    lowered = open_decoder(ort_lowered(name))
    assert lowered.manifest.form == ("buffer" if KV_BUFFER[name] else "concat")
    # every grouped-query draft layer attends through ONNX Attention (causal_gqa4_b4's with its mask); the
    # llama draft has as many kv heads as query heads, so nothing is repeated and nothing rewritten
    spec = exported(name).spec
    grouped = spec.num_heads > spec.num_kv_heads
    attentions = _rewrote(lowered.manifest, "draft-attention", "draft", "attentions")
    assert attentions == (lowered.manifest.draft.num_layers if grouped else 0)
    cached = KV_BUFFER[name] and lowered.manifest.dtype == "float32"  # a cos/sin cache needs the position bound
    assert (_rewrote(lowered.manifest, "rope-cache", "draft", "rotations") > 0) == cached
    export = decoders(name)
    prompts = varied_prompts(lowered.manifest.vocab_size, 4, seed=3, shortest=2, longest=12)
    wants = [export.generate(prompt, 32, "greedy", stop_token_ids=[]).tokens for prompt in prompts]
    if name in VARIED:  # the agreeing and tied pairs hardly tell prompts apart: their tokens check the structure only
        assert_discriminating(prompts, wants, lambda p: export.generate(p, 32, "greedy", stop_token_ids=[]).tokens)
    for prompt, want in zip(prompts, wants):  # full blocks: every step verifies, and rolls back, proposals
        assert lowered.generate(prompt, 32, "dflash", stop_token_ids=[]).tokens == want
        assert lowered.generate(prompt, 32, "dflash", stop_token_ids=[], verify="full").tokens == want
        assert lowered.generate(prompt, 32, "greedy", stop_token_ids=[]).tokens == want


def _export_kv(exported, manifest, ids: np.ndarray) -> dict[str, np.ndarray]:
    """The export's K/V rows for `ids` from position 0, by the lowering's past input name ([seq, kv, hd])."""
    export = exported("agree_b8").decoder()
    empty = {n: np.zeros((1, 0, manifest.target.num_kv_heads, manifest.target.head_dim), np.float32)
             for n in export.manifest.target.kv_inputs}
    want = export.target.run({"input_ids": ids[None], "position_ids": np.arange(len(ids))[None], **empty})
    return {past: want[present][0] for past, present in zip(manifest.target.kv_inputs, manifest.target.kv_outputs)}


def _buffer_call(session, ids: np.ndarray, start: int) -> None:
    end = start + len(ids)
    session.run({"input_ids": ids[None], "position_ids": np.arange(start, end)[None],
                 "seqlens_k": np.array([end - 1], np.int32), "total_sequence_length": np.array(end, np.int32)},
                ["greedy_ids"])


def test_buffer_form_writes_kv_in_place_into_buffers_that_grow_with_the_context(exported, ort_lowered):
    """After each call the session's own buffers hold the export's K/V rows (no copy handed back); they start
    at FIRST_ROWS rows and grow to ctx_len (512) when a call needs more, keeping the rows written before."""
    from dflash_onnx.targets.kv_rows import FIRST_ROWS

    lowered = open_decoder(ort_lowered("agree_b8"))
    session, manifest = lowered.target, lowered.manifest
    assert manifest.form == "buffer" and manifest.ctx_len == 512 and session.kv_buffers() == {}
    graph = onnx.load(str(ort_lowered("agree_b8") / "target.onnx"), load_external_data=False)
    rows = {d.dim_param or d.dim_value for v in graph.graph.input if v.name in manifest.target.kv_inputs
            for d in v.type.tensor_type.shape.dim[2:3]}
    assert rows == {"kv_buffer_rows"}  # the graph leaves the buffers' length to the session
    ids = np.random.default_rng(4).integers(2, 94, size=300)
    _buffer_call(session, ids[:6], 0)
    want = _export_kv(exported, manifest, ids[:6])
    for past, buffer in session.kv_buffers().items():
        assert buffer.shape == (1, manifest.target.num_kv_heads, FIRST_ROWS, manifest.target.head_dim)
        np.testing.assert_allclose(buffer[0, :, :6].transpose(1, 0, 2), want[past], atol=1e-5)
    _buffer_call(session, ids[6:], 6)  # 300 rows: past FIRST_ROWS, so every buffer doubles (to ctx_len)
    want = _export_kv(exported, manifest, ids)
    for past, buffer in session.kv_buffers().items():
        assert buffer.shape[2] == 512
        np.testing.assert_allclose(buffer[0, :, :300].transpose(1, 0, 2), want[past], atol=1e-4)
    with pytest.raises(DFlashError, match="513 rows exceeds the 512 rows"):
        _buffer_call(session, ids[:213], 300)


def test_a_lowering_whose_graph_fixes_the_buffer_rows_still_decodes(decoders, ort_lowered, tmp_path):
    """Lowerings made before the rows were left open declare ctx_len rows: the session allocates exactly those."""
    fixed = tmp_path / "fixed"
    shutil.copytree(ort_lowered("agree_b8"), fixed)
    graph = onnx.load(str(fixed / "target.onnx"), load_external_data=False)
    for value in [*graph.graph.input, *graph.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == "kv_buffer_rows":
                dim.dim_value = 512
    onnx.save(graph, str(fixed / "target.onnx"))
    lowered = open_decoder(fixed)
    assert {b.shape[2] for b in lowered.target.kv_buffers().values()} == {512}
    prompt = [5, 9, 2, 7, 7, 3]
    want = decoders("agree_b8").generate(prompt, 24, "greedy", stop_token_ids=[]).tokens
    assert lowered.generate(prompt, 24, "dflash", stop_token_ids=[]).tokens == want


def test_sliding_window_layers_get_their_window_in_the_buffer_form(exported, tmp_path):
    """varied_window_b8's target slides over 5 positions in layers 0 and 2: GroupQueryAttention's
    local_window_size masks as the export does, and the buffer form decodes HF greedy's tokens past the window, for
    prompts whose tokens beyond the window change the output (a window one row too wide would show)."""
    from dflash_onnx.exporter.models.target import hf_greedy
    from dflash_onnx.exporter.pair import load_target

    pair = exported("varied_window_b8")
    assert load_manifest(pair.out).target.kv_windows == [5, 0, 5, 0]
    lowered = lower_ort(pair.out, tmp_path / "sliding", OrtOptions(ctx_len=128), QUIET)
    assert lowered.form == "buffer" and lowered.lowering.rewrites["kv-buffer"]["target"]["sliding_windows"] == 2
    lm, decoder = load_target(pair.target_dir), open_decoder(tmp_path / "sliding")
    prompts = varied_prompts(lowered.vocab_size, 4, seed=8, shortest=8, longest=16)
    wants = [hf_greedy(lm, prompt, 16, None) for prompt in prompts]
    assert_discriminating(prompts, wants, lambda p: hf_greedy(lm, p, 16, None))
    for prompt, want in zip(prompts, wants):
        assert decoder.generate(prompt, 16, "greedy", stop_token_ids=[]).tokens == want
        assert decoder.generate(prompt, 16, "dflash", stop_token_ids=[], verify="full").tokens == want


def test_buffer_form_is_refused_where_it_would_change_the_output(exported, tmp_path):
    """An export that does not record its windows (made before they were): the lowering's check finds the
    unmasked buffer form's logits wrong and refuses it, naming the concat form; nothing is written."""
    source = tmp_path / "unrecorded"
    shutil.copytree(exported("causal_gqa4_b4").out, source)
    raw = json.loads((source / "dflash.json").read_text())
    raw["target"]["kv_windows"] = []
    (source / "dflash.json").write_text(json.dumps(raw))
    with pytest.raises(DFlashError, match="--kv-buffer off"):
        lower_ort(source, tmp_path / "sliding", OrtOptions(ctx_len=128), request=QUIET)
    assert not (tmp_path / "sliding").exists()


def test_rows_form_draft_keeps_the_exports_context_cache_in_its_buffers(exported, ort_lowered):
    """Proposal by proposal, the lowered draft session's buffers hold the rows the export's `present` holds,
    and the runner feeds it no K/V (the session writes each call's rows in place)."""
    from dflash_onnx.runtime.runners import RowsDraft, open_runners

    lowered, export = open_decoder(ort_lowered("agree_b8")), exported("agree_b8").decoder()
    _, rows = open_runners(lowered.manifest, lowered.target, lowered.draft, 256)
    _, concat = open_runners(export.manifest, export.target, export.draft, 256)
    assert isinstance(rows, RowsDraft)
    rng = np.random.default_rng(2)
    width = export.manifest.num_taps * export.manifest.target_hidden_size
    for count in (7, 8, 1, 3):
        context = rng.standard_normal((count, width)).astype(np.float32)
        block = rng.integers(0, 96, size=export.manifest.block_size)
        assert rows.propose(block, context, False).ids.tolist() == concat.propose(block, context, False).ids.tolist()
        assert rows.kv.length == concat.kv.length and not rows.kv.inputs and not rows.kv.outputs
        buffers = lowered.draft.kv_buffers()
        for past, present in zip(lowered.manifest.draft.kv_inputs, concat.kv.arrays):
            np.testing.assert_allclose(buffers[past][:, : rows.kv.length], present, atol=1e-5)


def test_buffer_form_capacity_is_checked_before_decoding(ort_lowered):
    decoder = open_decoder(ort_lowered("agree_b8"))
    capacity = 512 - (decoder.row_multiple - 1)  # positions kept for a padded call's last rows
    with pytest.raises(DFlashError, match=f"{capacity} positions this lowering holds"):
        decoder.generate([3] * 500, 20)
    open_decoder(ort_lowered("agree_b8"), batch_invariant=False).generate([3] * 500, 12, "greedy")


def test_decoding_up_to_the_capacity_matches_the_export(exported, decoders, ort_lowered):
    """The last blocks run past ctx_len (512) by up to a block: the draft's cos/sin cache covers them."""
    lowered = open_decoder(ort_lowered("agree_b8"))
    prompt = np.random.default_rng(5).integers(2, 94, size=512 - 22 - (lowered.row_multiple - 1)).tolist()
    want = decoders("agree_b8").generate(prompt, 22, "greedy", stop_token_ids=[]).tokens
    assert lowered.generate(prompt, 22, "dflash", stop_token_ids=[]).tokens == want


def test_manifest_records_the_lowering_and_the_graphs_are_fused(ort_lowered):
    out = ort_lowered("agree_b8")
    manifest = load_manifest(out)
    assert manifest.backend == "ort" and manifest.lowering.provider == "cpu"
    options = manifest.lowering.options
    assert (options["intra_op_threads"], options["draft_threads"], options["optimization_level"]) == (0, 0, "extended")
    measured = manifest.lowering.report["spinning"]  # --spinning auto: each mode timed quiet and loaded
    assert set(measured["modes"]) == {"on", "calls", "off"} and options["spinning"] == measured["chosen"]
    assert measured["chosen"] == min(measured["modes"], key=lambda m: measured["modes"][m]["quiet_ms"]
                                     * measured["modes"][m]["loaded_ms"])
    assert [p["name"] for p in manifest.passes] == ["rope-fusion", "ort-fusions"]
    assert list(manifest.lowering.rewrites) == ["rope-fusion", "ort-fusions", *REWRITES]
    assert 0 <= manifest.lowering.max_relative_difference <= ort_check.LOWERING_TOLERANCE["float32"]
    assert _rewrote(manifest, "kv-buffer", "target", "attentions") == manifest.target.num_layers
    assert {"seqlens_k", "total_sequence_length"} <= set(manifest.target.input_names())
    target = onnx.load(str(out / "target.onnx"), load_external_data=False)
    ops = [n.op_type for n in target.graph.node]
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= set(ops)
    assert ops.count("GroupQueryAttention") == manifest.target.num_layers
    assert "MultiHeadAttention" not in ops and "Expand" not in ops  # no per-head copy of the cache
    # head size 16: GroupQueryAttention applies RoPE itself from a cos/sin cache of ctx_len rows
    assert "RotaryEmbedding" not in ops and "Cos" not in ops
    gqa = [n for n in target.graph.node if n.op_type == "GroupQueryAttention"]
    assert all(onnx.helper.get_attribute_value(a) == 1 for n in gqa for a in n.attribute if a.name == "do_rotary")
    assert len(gqa[0].input) == 9
    draft = onnx.load(str(out / "draft.onnx"), load_external_data=False)
    # the draft attends through one ONNX Attention per layer, its K/V never repeated per query head
    draft_ops = [n.op_type for n in draft.graph.node]
    assert draft_ops.count("Attention") == _rewrote(manifest, "draft-attention", "draft", "attentions") \
        == manifest.draft.num_layers
    assert "MultiHeadAttention" not in draft_ops and "Expand" not in draft_ops
    # its K/V outputs are the new context rows only (the runner keeps the cache)
    assert manifest.lowering.draft_kv == "rows"
    assert _rewrote(manifest, "draft-rows", "draft", "outputs") == len(manifest.draft.kv_outputs)
    assert all(t.shape[1] == "ctx_new" for t in manifest.draft.outputs if t.name in manifest.draft.kv_outputs)
    # its rotations index a constant cos/sin cache by position: no angles computed per call
    assert draft_ops.count("RotaryEmbedding") == _rewrote(manifest, "rope-cache", "draft", "rotations") > 0
    assert not {"Sin", "Cos", "Range"} & set(draft_ops)
    shared = manifest.lowering.shared_with_target
    assert shared  # the embedding (and untied lm_head) are read from the target's data file
    locations = {t.name: {e.key: e.value for e in t.external_data}.get("location") for t in draft.graph.initializer}
    assert all(locations[name] == "target.onnx.data" for name in shared if name in locations)
    assert (out / "passes_report.json").is_file() and (out / "tokenizer.json").is_file()


def test_sessions_use_the_recorded_options(exported, tmp_path):
    out = tmp_path / "ort1"
    assert main(["lower", str(exported("agree_b8").out), "--target", "ort", "--out", str(out), "--passes", "none",
                 "--kv-buffer", "off", "--threads", "1", "--draft-threads", "2", "--spinning", "off", "--quiet"]) == 0
    manifest = load_manifest(out)
    assert manifest.passes == [] and manifest.lowering.options["passes"] == []
    decoder = open_decoder(out)
    options = decoder.target._session.get_session_options()
    assert options.intra_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    # the draft's threads stop spinning when its call ends: the target's verify comes next
    draft_options = decoder.draft._session.get_session_options()
    assert draft_options.intra_op_num_threads == 2
    assert draft_options.get_session_config_entry("session.force_spinning_stop") == "1"
    with pytest.raises(RuntimeError, match="does not have configuration"):  # the target's keep spinning
        options.get_session_config_entry("session.force_spinning_stop")
    assert decoder.generate([4, 5, 6], 8).tokens == open_decoder(exported("agree_b8").out).generate([4, 5, 6], 8).tokens


def test_refusals_leave_nothing_behind(exported, ort_lowered, tmp_path, monkeypatch):
    source = exported("agree_b8").out
    with pytest.raises(DFlashError, match="no CUDAExecutionProvider.*onnxruntime-gpu"):
        lower_ort(source, tmp_path / "cuda", OrtOptions(provider="cuda", kv_buffer=False), QUIET)
    with pytest.raises(DFlashError, match="positive count"):
        lower_ort(source, tmp_path / "threads", OrtOptions(draft_threads=-1), QUIET)
    with pytest.raises(DFlashError, match="keep ort-fusions"):
        lower_ort(source, tmp_path / "nofusion", OrtOptions(passes=()), QUIET)
    with pytest.raises(DFlashError, match="below two blocks"):
        lower_ort(source, tmp_path / "short", OrtOptions(ctx_len=8), QUIET)
    with pytest.raises(DFlashError, match="--provider tpu: choose one of cpu, cuda"):
        lower_ort(source, tmp_path / "x", OrtOptions(provider="tpu"), QUIET)
    with pytest.raises(DFlashError, match="--passes draft-rows,kv-buffer: the ORT lowering applies its own"):
        lower_ort(source, tmp_path / "own", OrtOptions(passes=("rope-fusion", "ort-fusions", "kv-buffer",
                                                               "draft-rows")), QUIET)
    with pytest.raises(DFlashError, match="already lowered"):
        lower_ort(ort_lowered("agree_b8"), tmp_path / "again", request=QUIET)
    monkeypatch.setitem(ort_check.LOWERING_TOLERANCE, "float32", -1.0)  # every output now "differs"
    with pytest.raises(DFlashError, match="changes draft output .* --passes none"):
        lower_ort(source, tmp_path / "checked", request=QUIET)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_cli_lower_ort_errors_are_one_line(exported, tmp_path, capsys):
    assert main(["lower", str(exported("agree_b8").out), "--target", "ort", "--out", str(tmp_path / "o"),
                 "--provider", "cuda", "--kv-buffer", "off", "--quiet"]) == 2
    assert "onnxruntime-gpu" in capsys.readouterr().err
    assert main(["lower", str(exported("agree_b8").out), "--target", "ort", "--out", str(tmp_path / "o"),
                 "--provider", "cuda", "--quiet"]) == 2
    assert "--dtype float16" in capsys.readouterr().err



def test_buffer_form_rotation_holds_at_long_positions(exported, ort_lowered):
    """GroupQueryAttention's own RoPE (cos/sin cache) matches the export's rotation 500 positions in."""
    from dflash_onnx.runtime.runners import open_runners

    lowered, export = open_decoder(ort_lowered("agree_b8")), exported("agree_b8").decoder()
    ids = np.random.default_rng(5).integers(0, 96, size=500)
    runners = [open_runners(d.manifest, d.target, None, 256)[0] for d in (lowered, export)]
    for runner in runners:
        runner.forward(ids)
        runner.commit(500)
    block = np.random.default_rng(6).integers(0, 96, size=8)
    got, want = (runner.forward(block, len(block)) for runner in runners)
    assert np.abs(got.logits - want.logits).max() <= 1e-4 * np.abs(want.logits).max()
    assert np.abs(got.context - want.context).max() <= 1e-4 * np.abs(want.context).max()


def test_a_quantized_export_lowers_and_decodes_its_own_greedy_tokens(exported, tmp_path):
    """int4 (MatMulNBits, int8 activations) then the ORT lowering: DFlash == the quantized export's greedy."""
    from dflash_onnx.passes.pipeline import apply_pipeline

    quantized = tmp_path / "int4"
    apply_pipeline(exported("agree_b8").out, ["int4"], quantized, {"*": {"block_size": "16"}}, QUIET)
    lowered = lower_ort(quantized, tmp_path / "ort", OrtOptions(ctx_len=256), QUIET)
    assert lowered.form == "buffer"
    assert [p["name"] for p in lowered.passes] == ["int4", "rope-fusion", "ort-fusions"]
    # q/k/v and gate/up of every target layer read one activation: each group is one MatMulNBits and a Split
    fused = lowered.lowering.rewrites["sibling-matmuls"]["target"]["matmuls_fused"]
    assert fused == 5 * exported("agree_b8").spec.target_layers
    target = onnx.load(str(tmp_path / "ort" / "target.onnx"), load_external_data=False)
    assert sum(n.op_type == "Split" for n in target.graph.node) == 2 * exported("agree_b8").spec.target_layers
    # compared with the quantized matmuls computing in float, the lowering is held to the float tolerance
    assert lowered.lowering.max_relative_difference <= ort_check.LOWERING_TOLERANCE["float32"]
    assert ort_check.float_accuracy(quantized / "target.onnx") is not None
    assert ort_check.float_accuracy(exported("agree_b8").out / "target.onnx") is None
    _assert_a_wrong_rewrite_is_refused(quantized, tmp_path / "ort")
    decoder, reference = open_decoder(tmp_path / "ort"), open_decoder(quantized)
    for prompt in ([4, 5, 6], [9, 1, 2, 8, 3]):
        want = reference.generate(prompt, 24, "greedy", stop_token_ids=[]).tokens
        assert decoder.generate(prompt, 24, "dflash", stop_token_ids=[]).tokens == want
        assert decoder.generate(prompt, 24, "greedy", stop_token_ids=[]).tokens == want
    _assert_batch_invariant(decoder)


def _assert_a_wrong_rewrite_is_refused(quantized, directory) -> None:
    """A lowered quantized graph whose normalization is slightly off (epsilon 1e-6 -> 1e-3, the size of error a
    wrong fusion makes) fails the lowering's check."""
    path = directory / "target.onnx"
    original = path.read_bytes()
    graph = onnx.load(str(path), load_external_data=False)
    norm = next(n for n in graph.graph.node if n.op_type.endswith("SimplifiedLayerNormalization"))
    next(a for a in norm.attribute if a.name == "epsilon").f = 1e-3
    onnx.save(graph, str(path))
    try:
        with pytest.raises(DFlashError, match="the ORT lowering changes"):
            ort_check.check_lowering(quantized, load_manifest(quantized), directory, load_manifest(directory))
    finally:
        path.write_bytes(original)


def _assert_batch_invariant(decoder) -> None:
    """The lowering measured a row multiple with which a token's logits are the same bits whether its call had
    one row (a greedy step) or a block (a DFlash verify), and the decoder pads to it."""
    from dflash_onnx.runtime.runners import open_runners

    measured = decoder.manifest.lowering.report["batch_invariance"]
    assert measured["invariant"] and decoder.row_multiple == measured["row_multiple"] >= 1
    assert measured["differences"][str(measured["row_multiple"])] == 0.0
    assert all(d > 0 for m, d in measured["differences"].items() if int(m) < measured["row_multiple"])
    ids = np.random.default_rng(3).integers(0, decoder.manifest.vocab_size, size=7 + 8)
    runner, _ = open_runners(decoder.manifest, decoder.target, None, 256, decoder.row_multiple)
    runner.forward(ids[:7])
    runner.commit(7)
    block = runner.forward(ids[7:], 8).logits.copy()
    singles = []
    for position in range(7, 15):
        singles.append(runner.forward(ids[position : position + 1], 1).logits.copy())
        runner.commit(position + 1)
    np.testing.assert_array_equal(np.concatenate(singles), block)


def _reshape_chain(final_shape: list[int]) -> onnx.ModelProto:
    """x [batch, seq, 8] -> Reshape [batch, seq, 2, 4] -> Reshape `final_shape` -> Relu."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Reshape", ["x", "heads"], ["split"]),
             helper.make_node("Reshape", ["split", "flat"], ["y"]),
             helper.make_node("Relu", ["y"], ["out"])]
    final = ["batch", "seq", *final_shape]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, final)],
        [helper.make_tensor("heads", TensorProto.INT64, [4], [0, 0, 2, 4]),
         helper.make_tensor("flat", TensorProto.INT64, [len(final)], [0, 0, *final_shape])],
        value_info=[helper.make_tensor_value_info("split", TensorProto.FLOAT, ["batch", "seq", 2, 4]),
                    helper.make_tensor_value_info("y", TensorProto.FLOAT, final)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_reshape_round_trips_are_removed_and_other_chains_kept():
    import onnxruntime as ort
    from passtools import apply_pass

    from dflash_onnx.passes.tidy import run as tidy

    x = np.random.default_rng(0).standard_normal((1, 3, 8)).astype(np.float32)
    round_trip, details = apply_pass(tidy, _reshape_chain([8]))
    assert [n.op_type for n in round_trip.graph.node] == ["Relu"] and round_trip.graph.node[0].input[0] == "x"
    assert details["reshape_round_trips_removed"] == 1
    reshaped, _ = apply_pass(tidy, _reshape_chain([4, 2]))  # ends in another shape: both reshapes stay
    assert [n.op_type for n in reshaped.graph.node] == ["Reshape", "Reshape", "Relu"]
    for model, shape in ((round_trip, (1, 3, 8)), (reshaped, (1, 3, 4, 2))):
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_array_equal(session.run(None, {"x": x})[0], np.maximum(x, 0).reshape(shape))


def test_every_rewrite_reports_its_findings_per_graph(ort_lowered):
    """The lowering's rewrites run as passes: each one's row per graph is in passes_report.json, and the
    manifest keeps the same findings by pass and graph."""
    import json

    out = ort_lowered("agree_b8")
    manifest = load_manifest(out)
    rows = {(r["pass"], r["graph"]): r for r in json.loads((out / "passes_report.json").read_text())}
    assert [p for p, g in rows if g == "target"] == ["rope-fusion", "ort-fusions", *REWRITES]
    for name in REWRITES:
        for graph in ("target", "draft"):
            assert rows[(name, graph)]["details"] == manifest.lowering.rewrites[name][graph]
    layers = manifest.target.num_layers
    assert rows[("kv-buffer", "target")]["details"]["attentions"] == layers
    assert rows[("kv-buffer", "target")]["nodes_after"] < rows[("kv-buffer", "target")]["nodes_before"]
    assert "skipped" in rows[("kv-buffer", "draft")]["details"]
    assert "skipped" in rows[("draft-rows", "target")]["details"]
    assert rows[("draft-attention", "draft")]["details"]["attentions"] == manifest.draft.num_layers
    assert rows[("tidy", "target")]["details"]["reshape_round_trips_removed"] > 0


def test_rows_session_refuses_a_context_past_its_buffers_before_writing(ort_lowered):
    """The rows are written by pointer into the session's buffers: a call that would run past them is refused
    before ORT writes anything."""
    from dflash_onnx.targets.ort.session import OrtRowsSession

    decoder = open_decoder(ort_lowered("agree_b8"))
    session, manifest = decoder.draft, decoder.manifest
    assert isinstance(session, OrtRowsSession) and session.retains_state
    width = manifest.num_taps * manifest.target_hidden_size
    rows = 8
    start = manifest.ctx_len - rows + 1
    feeds = {"input_ids": np.full((1, manifest.block_size), 3, np.int64),
             "target_hidden": np.zeros((1, rows, width), np.float32),
             "position_ids": np.arange(start, start + rows + manifest.block_size, dtype=np.int64)[None]}
    before = session.kv_buffers()
    with pytest.raises(DFlashError, match=f"exceeds the {manifest.ctx_len} rows"):
        session.run(feeds, ["draft_ids"])
    assert all(np.array_equal(before[name], after) for name, after in session.kv_buffers().items())
    feeds["position_ids"] -= 1  # the last rows that fit
    assert session.run(feeds, ["draft_ids"])["draft_ids"].shape == (1, manifest.block_size - 1)


def test_cuda_is_refused_for_a_float32_buffer_form_before_anything_is_written(exported, tmp_path):
    with pytest.raises(DFlashError, match="float16"):
        lower_ort(exported("agree_b8").out, tmp_path / "cuda", OrtOptions(provider="cuda"), request=QUIET)
    assert not (tmp_path / "cuda").exists()


@pytest.mark.parametrize("mode, spin, stop", [("on", None, None), ("calls", None, "1"), ("off", "0", None)])
def test_spinning_modes_reach_the_target_session(ort_lowered, mode, spin, stop):
    from dflash_onnx.targets.ort.session import open_session

    manifest = load_manifest(ort_lowered("agree_b8"))
    options = open_session(ort_lowered("agree_b8"), manifest, "target", spinning=mode)._session.get_session_options()

    def entry(key: str):
        try:
            return options.get_session_config_entry(key)
        except RuntimeError:  # not set
            return None
    assert (entry("session.intra_op.allow_spinning"), entry("session.force_spinning_stop")) == (spin, stop)


def test_spinning_option_reads_older_lowerings_and_refuses_unknown_modes():
    assert OrtOptions(allow_spinning=False).spinning_mode() == "off"  # written before `spinning` existed
    assert OrtOptions().spinning_mode() == "on" and OrtOptions(spinning="calls").spinning_mode() == "calls"
    with pytest.raises(DFlashError, match="--spinning sometimes: choose one of auto, on, calls, off"):
        OrtOptions(spinning="sometimes").validate(8)


def test_the_check_holds_one_graph_session_at_a_time(exported, ort_lowered):
    """The export's sessions, then the lowering's, one graph at a time: the check's peak memory is the largest
    graph's session, not the pair's twice (at the Qwen3-0.6B shape in float32 one target session holds 3 GB)."""
    import gc
    import weakref

    from dflash_onnx.targets import open_session
    from dflash_onnx.targets.check import compare_lowering
    from dflash_onnx.targets.ort.session import OrtSession

    source, directory = exported("agree_b8").out, ort_lowered("agree_b8")
    exported_manifest, manifest = load_manifest(source), load_manifest(directory)
    opened: list = []
    overlaps: list = []

    def tracked(open_graph):
        def open_one(graph: str):
            gc.collect()
            overlaps.append([name for name, ref in opened if ref() is not None])
            session = open_graph(graph)
            opened.append((graph, weakref.ref(session)))
            return session
        return open_one

    differences = compare_lowering(
        exported_manifest, tracked(lambda g: OrtSession(source / getattr(exported_manifest, g).file)),
        tracked(lambda g: open_session(directory, manifest, g)), manifest).differences
    assert [graph for graph, _ in opened] == ["draft", "target", "draft", "target"]
    assert overlaps == [[], [], [], []] and max(d for _, d in differences) < 1e-4


def test_inputs_copied_when_bound_are_bound_again_after_each_refill(ort_lowered):
    """The CUDA buffer form's wrong verify and decode calls (reported as a GroupQueryAttention defect) were our
    binding: ORT copies a host input to the device when it is bound, and the session bound each input before
    filling it and never again while its shape held. With copy-on-bind simulated on the CPU, every call of a
    prefill / verify / decode / decode sequence returns what a fresh session given the whole prefix returns."""
    directory = ort_lowered("agree_b8")
    manifest = load_manifest(directory)
    ids = np.random.default_rng(9).integers(2, 94, size=30)
    calls = [(0, 12), (12, 8), (20, 1), (21, 1), (22, 8)]

    def run(session, start, count):
        end = start + count
        return session.run({"input_ids": ids[None, start:end], "position_ids": np.arange(start, end)[None],
                            "seqlens_k": np.array([end - 1], np.int32),
                            "total_sequence_length": np.array(end, np.int32)}, ["target_hidden"])["target_hidden"]

    session = OrtBufferSession(directory / manifest.target.file, manifest)
    session._binding = CopiedWhenBound(session._binding, manifest.target.kv_inputs)
    session._inputs_copied_when_bound = True  # what a session on a device provider sets
    for start, count in calls:
        fresh = OrtBufferSession(directory / manifest.target.file, manifest)
        if start:
            run(fresh, 0, start)
        np.testing.assert_allclose(run(session, start, count), run(fresh, start, count), atol=1e-5)
