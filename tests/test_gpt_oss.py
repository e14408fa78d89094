"""gpt-oss targets: eager attention with per-head sink logits and additive (0 / lowest) masks over alternating
sliding and full layers (one dflash::SinkAttention node per layer, GroupQueryAttention with head_sink in the ORT
buffer form), and biased, clamped SwiGLU experts as one dflash::SwigluMoE node per layer (a function
computing every expert), which the ORT lowering runs as com.microsoft::MoE (only the routed experts) and int4 as
QMoE. Oracles: transformers' GptOssForCausalLM, its own forward and greedy `generate`, and the reference `dflash`
package on the same weights (parity)."""

from __future__ import annotations

import pytest
import torch
from spread import assert_decodes, discriminating_outputs, greedy_tokens, varied_prompts

from dflash_onnx.cli import main
from dflash_onnx.exporter.models.target import hf_greedy
from dflash_onnx.exporter.pair import load_target
from dflash_onnx.exporter.tiny import TinySpec, build_pair
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets import LowerRequest, open_decoder
from dflash_onnx.targets.ort.lower import lower_ort
from dflash_onnx.targets.ort.options import OrtOptions

# Leaning towards the favourite token as far as the context does (tests/spread.py): over 20 prompts of 4-39 tokens
# and 40 new tokens, 19 outputs of 20 distinct, the favourite 47% of the tokens, none unchanged when the prompt is cut
# to its last token, DFlash's tau 1.66 of 4 (unbiased, as before: tau 1.01, the draft never right)
SPEC = TinySpec(model_type="gpt_oss", num_experts=8, experts_per_token=2, agree=True, favourite_logit=0.3,
                tie_embeddings=False, block_size=4, target_layer_ids=[1, 2], seed=19, target_sliding_window=5,
                max_positions=131072)
# the equality tests' prompts, most longer than the sliding window
DECODED = varied_prompts(SPEC.vocab_size, 4, seed=5, shortest=4, longest=20)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from dflash_onnx.exporter.export import export_pair

    root = tmp_path_factory.mktemp("gpt_oss")
    target, draft = build_pair(SPEC, root)
    export_pair(target, draft, root / "out", progress=False)
    return root


@pytest.fixture(scope="module")
def references(gpt_oss) -> list[list[int]]:
    lm = load_target(gpt_oss / "target")
    return discriminating_outputs(DECODED, lambda prompt: hf_greedy(lm, prompt, NEW_TOKENS, None))


def test_the_wrapper_reproduces_sinks_and_sliding_windows_with_additive_masks(gpt_oss):
    """Boolean masks added to eager attention's scores would read as 0 / 1 (the issue's 0.51 logit difference):
    the wrapper hands gpt-oss additive masks, and matches the model's own forward past the sliding window."""
    from dflash_onnx.exporter.models.hybrid import wrap_target

    lm = load_target(gpt_oss / "target")
    assert lm.config._attn_implementation == "eager"
    tapped = wrap_target(lm, [1, 2])
    ids = torch.tensor([[40, 2, 66, 17, 9, 31, 8, 70, 12, 4, 51, 5, 9, 11, 3, 20]])  # past the window of 5
    with torch.no_grad():
        ours = tapped(ids, torch.arange(16)[None], *tapped.empty_cache())[0]
        theirs = lm(input_ids=ids).logits
        tapped.additive_masks = False
        boolean = tapped(ids, torch.arange(16)[None], *tapped.empty_cache())[0]
    assert float((ours - theirs).abs().max()) < 2e-5
    assert float((boolean - theirs).abs().max()) > 1e-2  # the check can fail


def test_export_parity_and_dflash_equal_hf_greedy_and_the_reference(gpt_oss, capsys):
    manifest = load_manifest(gpt_oss / "out")
    assert manifest.attention_sinks and "clamped at 7.0" in manifest.experts["activation"]
    ops = _ops(gpt_oss / "out" / "target.onnx")
    assert ops.count(("dflash", "SwigluMoE")) == ops.count(("dflash", "SinkAttention")) == SPEC.target_layers
    code = main(["parity", str(gpt_oss / "out"), "--prompts", "2", "--max-new-tokens", "16"])
    out = capsys.readouterr().out
    assert code == 0 and "dflash-ort == reference" in out and "MISMATCH" not in out, out


@pytest.mark.parametrize("kv_buffer", [True, False])
def test_the_ort_lowering_decodes_hf_greedy_in_both_forms(gpt_oss, references, kv_buffer):
    """Buffer form: each dflash::SinkAttention becomes GroupQueryAttention with the sinks as head_sink and the
    sliding layers' windows; concat form: the function stays (inlined by ORT). Experts as com.microsoft::MoE in both."""
    out = gpt_oss / ("buffer" if kv_buffer else "concat")
    lowered = lower_ort(gpt_oss / "out", out, OrtOptions(ctx_len=256, kv_buffer=kv_buffer),
                        LowerRequest(progress=False))
    ops = _ops(out / "target.onnx")
    assert ops.count(("com.microsoft", "MoE")) == SPEC.target_layers and ("dflash", "SwigluMoE") not in ops
    if kv_buffer:
        rewrites = lowered.lowering.rewrites["kv-buffer"]["target"]
        assert rewrites["sinks"] == SPEC.target_layers and rewrites["sliding_windows"] == SPEC.target_layers // 2
        assert ops.count(("com.microsoft", "GroupQueryAttention")) == SPEC.target_layers
    else:  # the function stays (ONNX Runtime's saved optimization inlines it)
        assert ("com.microsoft", "GroupQueryAttention") not in ops
    assert_decodes(open_decoder(out), DECODED, references, NEW_TOKENS)


def test_int4_quantizes_its_experts_into_qmoe_with_their_biases_and_activation(gpt_oss):
    """The int4 pass turns each dflash::SwigluMoE into QMoE (biases and the clamped SwiGLU carried over); the
    lowered int4 graph decodes greedy and DFlash to the same tokens."""
    import onnx

    main(["optimize", str(gpt_oss / "out"), "--passes", "int4", "--out", str(gpt_oss / "int4"), "--quiet"])
    lower_ort(gpt_oss / "int4", gpt_oss / "ort4", OrtOptions(ctx_len=256, kv_buffer=False),
              LowerRequest(progress=False))
    graph = onnx.load(str(gpt_oss / "ort4" / "target.onnx"), load_external_data=False)
    qmoe = [node for node in graph.graph.node if node.op_type == "QMoE"]
    assert len(qmoe) == SPEC.target_layers
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in qmoe[0].attribute}
    assert attributes["swiglu_limit"] == pytest.approx(7.0) and attributes["activation_beta"] == pytest.approx(1.0)
    assert qmoe[0].input[4] and qmoe[0].input[7]  # fc1 and fc2 biases
    decoder = open_decoder(gpt_oss / "ort4")
    greedy = discriminating_outputs(DECODED, greedy_tokens(decoder, NEW_TOKENS))
    assert_decodes(decoder, DECODED, greedy, NEW_TOKENS)
    # the check finds each layer's router in the export, in the int4 export (QMoE fed by its TopK) and in the
    # lowering (ONNX Runtime may keep a float32 copy under its own name)
    from dflash_onnx.runtime.manifest import load_manifest
    from dflash_onnx.targets.ort.check import lowered_routers, routers

    for exported in ("out", "int4"):
        found = routers(gpt_oss / exported / "target.onnx", load_manifest(gpt_oss / exported))
        assert len(found.names) == SPEC.target_layers and (found.per_row, found.experts) == (2, SPEC.num_experts)
        assert lowered_routers(found, gpt_oss / "ort4" / "target.onnx") is not None


def _ops(path) -> list[tuple[str, str]]:
    import onnx

    return [(node.domain, node.op_type) for node in onnx.load(str(path), load_external_data=False).graph.node]


@pytest.mark.parametrize("backend", ["mlx", "ai100", "coreml"])
def test_the_other_lowerings_refuse_its_experts_in_one_line(backend, gpt_oss, tmp_path, capsys):
    code = main(["lower", str(gpt_oss / "out"), "--target", backend, "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "mixture-of-experts" in err, err


def _mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[experts, outputs, inputs] float -> MXFP4 blocks [experts, outputs, inputs / 32, 16] and exponent scales
    [experts, outputs, inputs / 32], as gpt-oss checkpoints store them (nearest FP4 value, low nibble first)."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    values = torch.tensor(FP4_VALUES)
    experts, outputs, inputs = weight.shape
    groups = weight.reshape(experts, outputs, inputs // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(dim=-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - values).abs().argmin(dim=-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_a_checkpoint_with_mxfp4_experts_exports_streamed_dequantized_as_transformers_loads_it(tmp_path):
    """gpt-oss ships its experts as MXFP4: the streamed export dequantizes them one tensor at a time with
    transformers' own conversion, and decodes the tokens of the model transformers loads from the same files."""
    import json

    from safetensors.torch import load_file, save_file

    from dflash_onnx.exporter.export import export_pair

    target, draft = build_pair(SPEC, tmp_path)
    weights = load_file(str(target / "model.safetensors"))
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4(weights.pop(name).transpose(1, 2).contiguous())
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (target / "config.json").write_text(json.dumps(config))
    export_pair(target, draft, tmp_path / "out", progress=False)
    lm, decoder = load_target(target), open_decoder(tmp_path / "out")
    assert not any(n.endswith("_blocks") for n, _ in lm.named_parameters())  # transformers dequantized them
    assert_decodes(decoder, DECODED, discriminating_outputs(DECODED, lambda p: hf_greedy(lm, p, NEW_TOKENS, None)),
                   NEW_TOKENS)
