"""CoreML: the stateful modules decode like ONNX Runtime; the packages convert here and have the expected spec.

Prediction needs macOS 15+, so the converted math is proven on the PyTorch modules that are traced for
conversion (driven through the same runners the CoreML session uses), and the packages are checked
through their spec.
"""

from __future__ import annotations

import json
import platform
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_onnx.exporter.models.stateful import StatefulDraft, StatefulTarget
from dflash_onnx.exporter.models.target import TappedTarget
from dflash_onnx.exporter.pair import load_draft, load_target
from dflash_onnx.runtime.decode import Decoder
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets import LowerRequest, open_decoder

ct = pytest.importorskip("coremltools", reason="coremltools is not installed: pip install 'coremltools>=9,<10'")

from dflash_onnx.targets.coreml.check import TorchStatefulSession  # noqa: E402
from dflash_onnx.targets.coreml.lower import lower_coreml  # noqa: E402
from dflash_onnx.targets.coreml.options import CoremlOptions  # noqa: E402

CTX_LEN, PREFILL = 96, 16


@pytest.fixture(scope="session")
def coreml_lowered(exported, tmp_path_factory):
    out = tmp_path_factory.mktemp("coreml") / "agree_b8"
    lower_coreml(exported("agree_b8").out, out, CoremlOptions(ctx_len=CTX_LEN, prefill_len=PREFILL),
                 LowerRequest(progress=False))
    return out


def _stateful_decoder(pair, lowered_manifest) -> Decoder:
    lm = load_target(pair.target_dir, "float32")
    draft = load_draft(pair.draft_dir, lm, "float32")
    tapped = TappedTarget(lm, lowered_manifest.target_layer_ids).eval()
    target = StatefulTarget(tapped, draft, CTX_LEN, dtype=torch.float32).eval()
    stateful_draft = StatefulDraft(draft, CTX_LEN, lowered_manifest.block_size, dtype=torch.float32).eval()
    return Decoder(lowered_manifest, TorchStatefulSession(target, ["greedy_ids", "logits", "context_hidden"]),
                   TorchStatefulSession(stateful_draft, ["draft_ids", "draft_confidence", "logits"]))


@pytest.mark.parametrize("name", ["agree_b8", "causal_gqa4_b4", "llama_sliding_b16"])
def test_stateful_modules_decode_exactly_like_ort(name, exported, decoders, coreml_lowered):
    pair = exported(name)
    template = load_manifest(coreml_lowered)
    source = decoders(name).manifest  # this pair's facts in the lowered (retained, consecutive-padding) form
    manifest = replace(template, block_size=source.block_size, target_layer_ids=source.target_layer_ids,
                       mask_token_id=source.mask_token_id, vocab_size=source.vocab_size, dtype="float32",
                       prefill_len=max(PREFILL, source.block_size))
    ours, ort = _stateful_decoder(pair, manifest), decoders(name)
    rng = np.random.default_rng(4)
    for _ in range(4):
        prompt = rng.integers(2, pair.spec.vocab_size - 1, size=int(rng.integers(1, 20))).tolist()
        for mode in ("dflash", "greedy"):
            got = ours.generate(prompt, 24, mode, stop_token_ids=[])
            want = ort.generate(prompt, 24, mode, stop_token_ids=[])
            assert got.tokens == want.tokens and got.acceptance_lengths == want.acceptance_lengths


def test_stateful_target_matches_the_hf_model(exported):
    pair = exported("causal_gqa4_b4")  # GQA 4 and a hybrid sliding-window target
    lm = load_target(pair.target_dir, "float32")
    draft = load_draft(pair.draft_dir, lm, "float32")
    tapped = TappedTarget(lm, [0, 2]).eval()
    stateful = StatefulTarget(tapped, draft, CTX_LEN, dtype=torch.float32).eval()
    ids = torch.randint(2, 90, (1, 13))
    with torch.no_grad():
        want = lm(input_ids=ids).logits
        first = stateful(ids[:, :8], torch.arange(8)[None])[1]
        second = stateful(ids[:, 8:], torch.arange(8, 13)[None])[1]
    assert torch.allclose(torch.cat([first, second], dim=1), want, atol=1e-4)


def test_target_parts_in_a_chain_equal_the_whole_target(exported):
    """Parts of the target (a tapped layer in the first and last, none in the middle) called in turn, hidden and
    tap_sum passed on, each with its own layers' states: the whole target's ids, logits and context, call after
    call."""
    pair = exported("causal_gqa4_b4")
    lm = load_target(pair.target_dir, "float32")
    draft = load_draft(pair.draft_dir, lm, "float32")
    tapped = TappedTarget(lm, [0, 2]).eval()
    whole = StatefulTarget(tapped, draft, CTX_LEN, 4.0, dtype=torch.float32).eval()
    parts = [StatefulTarget(tapped, draft, CTX_LEN, 4.0, torch.float32, layers).eval()
             for layers in ((0, 1), (1, 2), (2, tapped.num_layers))]
    assert [p.state_names for p in parts][:2] == [["key_cache_0", "value_cache_0"], ["key_cache_1", "value_cache_1"]]
    assert parts[1].fc_weight is None and parts[0].fc_weight.shape[1] == parts[2].fc_weight.shape[1]
    ids = torch.randint(2, 90, (1, 13))
    for rows in (slice(0, 8), slice(8, 13)):
        positions = torch.arange(13)[rows][None]
        with torch.no_grad():
            want = whole(ids[:, rows], positions)
            hidden, tap_sum = parts[0](ids[:, rows], positions)
            hidden, tap_sum = parts[1](hidden, positions, tap_sum)
            got = parts[2](hidden, positions, tap_sum)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)
        assert torch.equal(got[0], want[0])


def test_one_multifunction_package_with_states_and_fixed_shapes(coreml_lowered, exported):
    """model.mlpackage: the target's decode (1), verify (block) and prefill functions and the draft's two, each with
    fixed shapes and its graph's float16 states; each weight stored once (the draft's embedding and lm_head are
    the target's)."""
    manifest = load_manifest(coreml_lowered)
    spec = exported("agree_b8").spec
    assert manifest.backend == "coreml" and manifest.form == "retained" and manifest.lowering.padding == "consecutive"
    assert manifest.lowering.functions == {
        "target": {"input": "input_ids", "rows": {"decode": 1, "verify": spec.block_size, "prefill": PREFILL}},
        "draft": {"input": "context_hidden", "rows": {"draft": spec.block_size, "draft_prefill": PREFILL}}}
    package = coreml_lowered / "model.mlpackage"
    assert manifest.target.file == manifest.draft.file == "model.mlpackage"
    model_spec = ct.models.MLModel(str(package), skip_model_load=True).get_spec()
    described = {f.name: f for f in model_spec.description.functions}
    assert model_spec.description.defaultFunctionName == "decode" and model_spec.specificationVersion >= 9
    for graph, inputs, outputs, layers in (
            ("target", ["input_ids", "position_ids"], ["greedy_ids", "logits", "context_hidden"], spec.target_layers),
            ("draft", ["input_ids", "context_hidden", "ctx_position_ids", "position_ids"],
             ["draft_ids", "draft_confidence", "logits"], spec.draft_layers)):
        for name, rows in manifest.lowering.functions[graph]["rows"].items():
            function = described[name]
            assert [i.name for i in function.input] == inputs and [o.name for o in function.output] == outputs
            states = {s.name: list(s.type.stateType.arrayType.shape) for s in function.state}
            assert len(states) == 2 * layers
            assert set(map(tuple, states.values())) == {(1, spec.num_kv_heads, CTX_LEN, spec.head_dim)}
            assert all(s.type.stateType.arrayType.dataType == ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT16
                       for s in function.state)
            sized = function.input[0 if graph == "target" else 1].type.multiArrayType.shape
            assert list(sized)[:2] == [1, rows]  # fixed shapes: no enumerated or range dims
    weights = package / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    vocab_tensor = spec.vocab_size * spec.hidden_size * 2  # float16 bytes of the embedding
    layer = 2 * spec.hidden_size * (spec.num_heads + spec.num_kv_heads) * spec.head_dim * 2
    assert weights.stat().st_size < 2 * vocab_tensor + spec.target_layers * 8 * layer  # nothing stored per function


@pytest.mark.skipif(platform.system() == "Darwin", reason="on macOS the CoreML session runs")
def test_coreml_backend_says_it_needs_macos(coreml_lowered, capsys):
    from dflash_onnx.cli import main

    assert main(["generate", str(coreml_lowered), "--backend", "coreml", "--prompt-ids", "3,4"]) == 2
    assert "needs macOS 15" in capsys.readouterr().err
    with pytest.raises(DFlashError, match="--backend coreml"):
        open_decoder(coreml_lowered, backend="ort")


def test_consecutive_padding_reserves_the_tail(coreml_lowered):
    from dflash_onnx.runtime.runners import RetainedTarget

    runner = RetainedTarget(TorchStatefulSession(None, []), load_manifest(coreml_lowered))  # positions only
    assert runner.capacity == CTX_LEN - PREFILL
    assert runner.positions(10, 3, 8).tolist() == [list(range(10, 18))]  # padding continues the positions
    with pytest.raises(DFlashError, match="larger --ctx-len"):
        runner.positions(CTX_LEN - PREFILL, 1, 8)
    manifest = load_manifest(coreml_lowered)
    assert runner.chunks(1) == [(0, 1, 1)]  # --batch-invariant off: a greedy step runs the decode function
    assert manifest.lowering.row_multiple == manifest.block_size  # on (default): the verify function's program
    invariant = RetainedTarget(TorchStatefulSession(None, []), manifest, manifest.lowering.row_multiple)
    assert invariant.chunks(1) == [(0, 1, manifest.block_size)]


@pytest.mark.parametrize("options, message", [
    (CoremlOptions(prefill_len=12), "multiple of the block size"),
    (CoremlOptions(ctx_len=16, prefill_len=16), "at least two prefill chunks"),
    (CoremlOptions(compute_units="npu"), "choose from"),
])
def test_bad_coreml_options(options, message, exported, tmp_path):
    with pytest.raises(DFlashError, match=message):
        lower_coreml(exported("agree_b8").out, tmp_path / "out", options, LowerRequest(progress=False))
    assert not list(tmp_path.iterdir())


def test_a_conversion_too_big_for_the_machine_names_the_parts_that_fit(exported, tmp_path, monkeypatch):
    from dflash_onnx.artifacts import publish

    source = exported("agree_b8").out
    monkeypatch.delenv(publish.MEMORY_CHECK_ENV, raising=False)
    monkeypatch.setattr(publish, "available_memory", lambda: 1024)
    with pytest.raises(DFlashError, match=r"needs about .* convert the target in parts, e\.g\. --layers-per-part 1 "
                                          r"\(about [\d.]+ GiB at its peak\)"):
        lower_coreml(source, tmp_path / "out", CoremlOptions(ctx_len=CTX_LEN, prefill_len=PREFILL),
                     LowerRequest(progress=False))
    assert not list(tmp_path.iterdir())


def _operations(package, function: str) -> list:
    """The MIL operations of a package's function (read from its spec: no CoreML runtime needed)."""
    spec = ct.models.MLModel(str(package), skip_model_load=True).get_spec()
    main = spec.mlProgram.functions[function]
    return list(main.block_specializations[main.opset].operations)


def test_packages_use_fused_attention_on_grouped_kv(coreml_lowered, exported):
    """The golden spec: one fused scaled_dot_product_attention per layer over the kv heads' buffers (no K/V
    tiled per query head: the one `tile` repeats the [T, ctx] mask per query group), and each layer's K/V
    written to its state by a slice_update."""
    spec = exported("agree_b8").spec
    for function, layers in (("decode", spec.target_layers), ("verify", spec.target_layers),
                             ("prefill", spec.target_layers), ("draft", spec.draft_layers)):
        kinds = [op.type for op in _operations(coreml_lowered / "model.mlpackage", function)]
        assert kinds.count("scaled_dot_product_attention") == layers
        assert kinds.count("write_state") == 2 * layers and kinds.count("slice_update") == 2 * layers
        assert kinds.count("tile") <= 1
        assert "softmax" not in kinds[: kinds.index("reduce_argmax")]  # attention is fused (the draft's confidence
        # softmax comes after its argmax)


def test_int4_packages(exported, coreml_lowered, tmp_path, monkeypatch):
    out = tmp_path / "int4"
    lower_coreml(exported("agree_b8").out, out, CoremlOptions(ctx_len=CTX_LEN, prefill_len=PREFILL, bits=4),
                 LowerRequest(progress=False))
    spec = exported("agree_b8").spec
    for function, layers in (("verify", spec.target_layers), ("draft", spec.draft_layers)):
        kinds = [op.type for op in _operations(out / "model.mlpackage", function)]
        # q, o, gate, up and down at least (coremltools leaves tensors under 2048 values in float16: the tiny
        # pair's k/v projections, norms)
        assert kinds.count("constexpr_blockwise_shift_scale") >= 5 * layers
        assert kinds.count("scaled_dot_product_attention") == layers
    weights = Path("model.mlpackage", "Data", "com.apple.CoreML", "weights", "weight.bin")
    assert (out / weights).stat().st_size < 0.5 * (coreml_lowered / weights).stat().st_size  # the tiny pair: 0.36
    lowered = load_manifest(out).lowering
    assert lowered.options["bits"] == 4
    # checked against the modules with their weights rounded as the package holds them: float16 compute only
    assert lowered.max_relative_difference < 5e-3
    from dflash_onnx.targets.coreml import rounded_weights

    # a package whose blocks run along the other axis than the reference's (measured: 0.16 of the logit scale,
    # as with unrounded weights) is refused
    by_rows = rounded_weights.rounded
    monkeypatch.setattr(rounded_weights, "rounded", lambda weight, bits, size: by_rows(weight.t(), bits, size).t()
                        if weight.shape[0] % size == 0 else by_rows(weight, bits, size))
    with pytest.raises(DFlashError, match="the CoreML packages change target logits"):
        lower_coreml(exported("agree_b8").out, tmp_path / "wrong", CoremlOptions(ctx_len=CTX_LEN, prefill_len=PREFILL,
                                                                                 bits=4), LowerRequest(progress=False))
    with pytest.raises(DFlashError, match="--bits 3"):
        CoremlOptions(bits=3).validate(8)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_checks_rounded_weights_are_coremltools_quantization(bits):
    """The check's reference rounds the weights by coremltools' rule, written independently: equal to what
    coremltools' quantizer stores (its integers times its float16 scales), a block of zeros included; tensors it
    leaves in float16 (too small, or rows not a multiple of the block) unchanged."""
    from coremltools.optimize.coreml._quantization_passes import linear_quantize_weights

    from dflash_onnx.targets.coreml.rounded_weights import rounded

    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(bits)) * 0.05
    weight[3, 32:64] = 0
    with np.errstate(invalid="ignore"):  # coremltools divides the zero block by its zero scale
        params = linear_quantize_weights.blockwise_compress(weight.half().numpy(), nbits=bits,
                                                            mode="LINEAR_SYMMETRIC", signed=True, block_sizes=[1, 32])
    stored = params.data.astype(np.float16) * params.scale.repeat(32, axis=1)
    assert np.array_equal(rounded(weight, bits, 32).numpy(), stored.astype(np.float32))
    assert len(np.unique(rounded(weight, bits, 32).numpy()[0, :32])) <= 2**bits  # one block: its levels
    for small in (torch.randn(32, 64), torch.randn(96, 200)):
        assert torch.equal(rounded(small, bits, 32), small)


def test_rounded_weights_are_put_back_and_tied_ones_stay_tied():
    from dflash_onnx.targets.coreml.rounded_weights import rounded, rounded_weights

    embedding = torch.nn.Embedding(96, 64)
    head = torch.nn.Linear(64, 96, bias=False)
    head.weight = torch.nn.Parameter(embedding.weight.detach())  # tied: one tensor, two Parameters
    model = torch.nn.ModuleDict({"embed": embedding, "head": head, "norm": torch.nn.LayerNorm(64)})
    before = {name: param for name, param in model.named_parameters(remove_duplicate=False)}
    with rounded_weights(model, 4, 32):
        assert torch.equal(model["embed"].weight, rounded(before["embed.weight"], 4, 32))
        assert model["embed"].weight.data_ptr() == model["head"].weight.data_ptr()
        assert model["norm"].weight is before["norm.weight"]  # 1-D: coremltools leaves it float16
    assert all(param is before[name] for name, param in model.named_parameters(remove_duplicate=False))


def test_packages_evaluated_in_numpy_match_the_modules(coreml_lowered, exported, tmp_path, monkeypatch):
    """The lowering evaluates the packages it wrote from their spec in numpy (targets/coreml/mil_eval.py) on a
    prefill, a verify with a partial commit, a decode and draft proposals, against the float32 modules: greedy ids
    equal, logits within float16 rounding. A GQA-4 target with sliding-window layers too; a wrong op is refused."""
    assert load_manifest(coreml_lowered).lowering.max_relative_difference < 5e-3
    out = tmp_path / "gqa"
    lower_coreml(exported("causal_gqa4_b4").out, out, CoremlOptions(ctx_len=CTX_LEN, prefill_len=PREFILL),
                 LowerRequest(progress=False))
    assert load_manifest(out).lowering.max_relative_difference < 5e-3
    from dflash_onnx.targets.coreml import mil_eval

    monkeypatch.setitem(mil_eval.OPS, "rsqrt", lambda a: 1.0 / np.sqrt(a["x"].astype(np.float32) + 1.0))
    with pytest.raises(DFlashError, match="the CoreML packages change target logits"):
        lower_coreml(exported("agree_b8").out, tmp_path / "wrong", CoremlOptions(ctx_len=CTX_LEN, prefill_len=PREFILL),
                     LowerRequest(progress=False))
    assert not (tmp_path / "wrong").exists()


def test_a_draft_with_one_tap_evaluates_in_numpy(exported, tmp_path):
    """One tapped layer (the Qwen3-0.6B-shaped preset's draft): the features are a concat of one tensor, which the
    numpy evaluator once flattened (a one-argument list taken for the tensor itself)."""
    assert len(exported("agree_b2").spec.target_layer_ids) == 1
    out = tmp_path / "one_tap"
    lower_coreml(exported("agree_b2").out, out, CoremlOptions(ctx_len=CTX_LEN, prefill_len=PREFILL),
                 LowerRequest(progress=False))
    assert load_manifest(out).lowering.max_relative_difference < 5e-3


def test_dry_run_estimates_the_package(exported, coreml_lowered, tmp_path, capsys):
    """--dry-run converts nothing and estimates from the checkpoints' headers what the lowering writes: its
    float16 weights within 10 % of the real package's weight.bin, the states exactly."""
    from dflash_onnx.cli import main

    out = tmp_path / "dry"
    assert main(["lower", str(exported("agree_b8").out), "--target", "coreml", "--dry-run", "--ctx-len", str(CTX_LEN),
                 "--prefill-len", str(PREFILL), "--out", str(out), "--quiet"]) == 0
    assert "dry run, nothing converted: model.mlpackage" in capsys.readouterr().out
    found = json.loads((out / "estimate.json").read_text())
    real = (coreml_lowered / "model.mlpackage" / "Data" / "com.apple.CoreML" / "weights" / "weight.bin").stat().st_size
    assert abs(found["package_bytes"] - real) < 0.1 * real
    spec = exported("agree_b8").spec
    assert found["state_bytes"]["target"] == 2 * spec.target_layers * spec.num_kv_heads * CTX_LEN * spec.head_dim * 2
    assert sorted(p.name for p in out.iterdir()) == ["estimate.json"]  # nothing that could be run
    block = exported("agree_b8").spec.block_size  # a prefill chunk of one block: no function of its own
    planned = lower_coreml(exported("agree_b8").out, tmp_path / "one", CoremlOptions(ctx_len=CTX_LEN, prefill_len=block,
                                                                                      dry_run=True),
                           LowerRequest(progress=False))
    assert planned.lowering.functions["target"]["rows"] == {"decode": 1, "verify": block}
    assert planned.lowering.functions["draft"]["rows"] == {"draft": block}


def test_a_target_in_parts(exported, coreml_lowered, tmp_path):
    """--layers-per-part: each part of the target has its own functions, with its own layers' states, converted
    from the checkpoints read as needed and checked in numpy against the parts' modules; the parts run in turn
    decode exactly as the target in one part does."""
    from dflash_onnx.targets.coreml.check import MilSession
    from dflash_onnx.targets.coreml.session import part_packages

    spec = exported("agree_b8").spec
    out = tmp_path / "parts"
    lower_coreml(exported("agree_b8").out, out,
                 CoremlOptions(ctx_len=CTX_LEN, prefill_len=PREFILL, layers_per_part=2), LowerRequest(progress=False))
    manifest = load_manifest(out)
    parts = manifest.lowering.functions["target"]["parts"]
    assert parts == [[start, min(start + 2, spec.target_layers)] for start in range(0, spec.target_layers, 2)]
    assert len(parts) > 1 and manifest.lowering.max_relative_difference < 5e-3
    assert manifest.lowering.functions["target"]["packages"] == [f"target_part{k}.mlpackage" for k in range(len(parts))]
    assert manifest.draft.file == "draft.mlpackage" and sorted(p.name for p in out.glob("*.mlpackage")) == sorted(
        ["draft.mlpackage", *manifest.lowering.functions["target"]["packages"]])
    for k, (start, stop) in enumerate(parts):
        described = {f.name: f for f in ct.models.MLModel(str(out / f"target_part{k}.mlpackage"),
                                                           skip_model_load=True).get_spec().description.functions}
        assert set(described) == {f"{name}_{k}" for name in ("decode", "verify", "prefill")}
        for name in ("decode", "verify", "prefill"):
            function = described[f"{name}_{k}"]
            assert {s.name for s in function.state} == {f"{kind}_cache_{i}" for i in range(start, stop)
                                                         for kind in ("key", "value")}
            assert [i.name for i in function.input] == (["input_ids", "position_ids"] if k == 0 else
                                                        ["hidden_in", "position_ids", "tap_sum_in"])
            assert [o.name for o in function.output] == (["greedy_ids", "logits", "context_hidden"]
                                                         if stop == spec.target_layers else ["hidden", "tap_sum"])

    def decoder(directory):
        lowered = load_manifest(directory)
        functions = lowered.lowering.functions
        return Decoder(lowered, *(MilSession(part_packages(directory, functions[graph], getattr(lowered, graph).file),
                                             functions[graph]) for graph in ("target", "draft")))

    # the dry run's estimate counts every package: the draft's own embedding and lm_head included
    planned = lower_coreml(exported("agree_b8").out, tmp_path / "dry", CoremlOptions(
        ctx_len=CTX_LEN, prefill_len=PREFILL, layers_per_part=2, dry_run=True), LowerRequest(progress=False))
    written = sum(p.stat().st_size for p in out.glob("*.mlpackage/Data/com.apple.CoreML/weights/weight.bin"))
    assert abs(planned.lowering.report["estimate"]["package_bytes"] - written) < 0.03 * written  # 1 %; 6.6 % without

    in_parts, whole = decoder(out), decoder(coreml_lowered)
    for prompt in ([5, 6, 7], list(range(3, 23))):
        for mode in ("greedy", "dflash"):
            assert in_parts.generate(prompt, 12, mode, stop_token_ids=[]).tokens == \
                whole.generate(prompt, 12, mode, stop_token_ids=[]).tokens


def test_tied_weights_read_for_a_trace_share_storage_not_parameters(exported):
    """A part's weights read from the checkpoints (--layers-per-part): the draft's embedding and lm_head of a tied
    target are one tensor read once, held by two Parameters (torch.jit.trace refuses one Parameter in two places),
    and go back to the meta device after."""
    from dflash_onnx.exporter.lazy_weights import pair_sources, weights_loaded
    from dflash_onnx.exporter.pair import meta_pair

    pair = exported("causal_gqa4_b4")  # tied embeddings
    tapped, draft = meta_pair(pair.target_dir, pair.draft_dir, pair.spec.target_layer_ids)
    sources = pair_sources(tapped, draft, pair.target_dir, pair.draft_dir)
    block = pair.spec.block_size
    stateful = StatefulDraft(draft, CTX_LEN, block, torch.float16).eval()
    rows = torch.arange(4, dtype=torch.int32)[None]
    with weights_loaded([stateful], sources, torch.float16):
        assert draft.embed_tokens is not draft.lm_head and draft.embed_tokens.data_ptr() == draft.lm_head.data_ptr()
        assert draft.embed_tokens.dtype == torch.float16
        with torch.no_grad():
            torch.jit.trace(stateful, (torch.zeros(1, block, dtype=torch.int32),
                                       torch.zeros(1, 4, pair.spec.hidden_size, dtype=torch.float16), rows,
                                       4 + torch.arange(block, dtype=torch.int32)[None]), check_trace=False)
    assert {p.device.type for p in draft.parameters()} == {"meta"}
