"""Mixture-of-experts targets (Qwen3-MoE): checkpoints stored one tensor per expert export streamed through
transformers' own weight conversion, each MoE layer becomes one dflash::MoE node whose standard-op body any ONNX
runtime runs, and the ORT lowering computes only the routed experts (com.microsoft MoE, QMoE for int4) with every
token's result independent of the call it is in. Oracles: transformers' Qwen3MoeForCausalLM and its greedy
`generate`."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_onnx.cli import main
from exporter.lazy_weights import Checkpoint, converted_sources
from exporter.models.target import hf_greedy
from exporter.pair import load_target
from exporter.tiny import TinySpec, build_pair
from passes.pipeline import apply_pipeline
from runtime.errors import DFlashError
from runtime.manifest import load_manifest
from targets import LowerRequest, open_decoder
from targets.ort.lower import lower_ort
from targets.ort.options import OrtOptions

QUIET = LowerRequest(progress=False)
PROMPTS = ([4, 5, 6], [9, 1, 2, 8, 3, 30, 31])


def _ops(path) -> list[tuple[str, str]]:
    graph = onnx.load(str(path), load_external_data=False)
    return [(node.domain, node.op_type) for node in graph.graph.node]


@pytest.fixture(scope="module")
def moe(exported):
    return exported("moe_b4")


@pytest.fixture(scope="module")
def moe_ort(moe, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_ort") / "ort"
    lower_ort(moe.out, out, OrtOptions(ctx_len=256), QUIET)
    return out


@pytest.fixture(scope="module")
def hf_lm(moe):
    return load_target(moe.target_dir)


def test_the_checkpoint_stores_one_tensor_per_expert_and_the_conversion_is_transformers_own(moe, hf_lm):
    """What a Qwen3-MoE checkpoint ships (experts.{e}.gate_proj ...) read through transformers' conversion
    mapping gives exactly the fused parameters from_pretrained loads."""
    stored = load_file(str(moe.target_dir / "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in stored
    assert not any(key.endswith("gate_up_proj") for key in stored)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(moe.target_dir)))
    sources = converted_sources(meta, Checkpoint(moe.target_dir, "target"))
    layers = moe.spec.target_layers
    assert sorted(sources) == sorted(f"model.layers.{i}.mlp.experts.{kind}" for i in range(layers)
                                     for kind in ("gate_up_proj", "down_proj"))
    loaded = dict(hf_lm.named_parameters())
    for name, source in sources.items():
        assert source.shape == tuple(loaded[name].shape)
        torch.testing.assert_close(source.read(torch.float32), loaded[name], rtol=0, atol=0)


def test_a_checkpoint_missing_an_expert_is_refused_before_tracing(moe, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    for file in ("config.json", "generation_config.json", "tokenizer.json"):
        if (moe.target_dir / file).exists():
            (target / file).write_bytes((moe.target_dir / file).read_bytes())
    tensors = load_file(str(moe.target_dir / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(target / "model.safetensors"))
    from exporter.export import export_pair

    with pytest.raises(DFlashError, match=r"experts\.0\.gate_proj\.weight \(and 14 more tensors, converted to "
                                          r"model\.layers\.2\.mlp\.experts\.gate_up_proj\) .* do not convert as "
                                          r"transformers loads them \(.*\): the checkpoint does not match"):
        export_pair(target, moe.draft_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_each_moe_layer_exports_as_one_node_defined_by_a_local_function(moe):
    ops = _ops(moe.out / "target.onnx")
    assert ops.count(("dflash", "MoE")) == moe.spec.target_layers
    graph = onnx.load(str(moe.out / "target.onnx"), load_external_data=False)
    assert [(f.domain, f.name) for f in graph.functions] == [("dflash", "MoE")]
    assert {op for domain, op in ops if domain == ""}.isdisjoint({"Loop", "NonZero"})  # no data-dependent loop
    manifest = load_manifest(moe.out)
    assert manifest.experts == {"layers": 4, "experts": 8, "per_token": 2, "intermediate_size": 64}


def test_the_export_matches_transformers_and_dflash_decodes_its_greedy_tokens(moe):
    """parity: logits and K/V of both graphs against transformers' own classes, DFlash tokens == HF greedy."""
    from dflash_onnx.parity import run_parity

    report = run_parity(moe.out, num_prompts=2, max_new_tokens=16)
    assert report.ok, [c for c in report.checks if not c.ok]
    assert any(c.name == "tokens: dflash-ort == hf greedy" for c in report.checks)


def test_the_loaded_export_equals_the_streamed_one(moe, tmp_path):
    """--no-stream (from_pretrained, transformers' own loading) gives the same graph outputs."""
    from exporter.export import export_pair

    export_pair(moe.target_dir, moe.draft_dir, tmp_path / "loaded", progress=False, stream=False)
    ids = np.array([[3, 4, 5, 6, 7]])
    feeds = {"input_ids": ids, "position_ids": np.arange(5)[None]}
    outputs = []
    for directory in (moe.out, tmp_path / "loaded"):
        decoder = open_decoder(directory)
        feeds.update({name: np.zeros((1, 0, decoder.manifest.target.num_kv_heads, decoder.manifest.target.head_dim),
                                     np.float32) for name in decoder.manifest.target.kv_inputs})
        outputs.append(decoder.target.run(feeds, ["logits"])["logits"])
    np.testing.assert_array_equal(*outputs)


def test_the_ort_lowering_routes_tokens_to_their_experts_and_decodes_hf_greedy(moe, moe_ort, hf_lm):
    ops = _ops(moe_ort / "target.onnx")
    assert ops.count(("com.microsoft", "MoE")) == moe.spec.target_layers and ("dflash", "MoE") not in ops
    decoder = open_decoder(moe_ort)
    assert decoder.manifest.lowering.rewrites["moe-fusion"]["target"] == {"moe_nodes": 4}
    for prompt in PROMPTS:
        want = hf_greedy(hf_lm, prompt, 24, None)
        assert decoder.generate(prompt, 24, "dflash", stop_token_ids=[]).tokens == want
        assert decoder.generate(prompt, 24, "greedy", stop_token_ids=[]).tokens == want


def test_a_token_gives_the_same_bits_in_a_call_of_one_or_of_a_block(moe_ort):
    """Each token enters ORT's MoE kernel as a pair of rows, so an expert's row count is always even: the lowering
    measured the target batch-invariant, and a verify's rows equal the same tokens decoded one at a time."""
    from test_ort_lowering import _assert_batch_invariant

    _assert_batch_invariant(open_decoder(moe_ort))


def _moe_graph(fused: bool) -> ir.Model:
    """One dflash::MoE node over random experts (the export's function), lowered by the moe-fusion pass when
    `fused`."""
    from exporter.models.experts import add_moe_function
    from passes import PassContext
    from passes.experts import fuse

    rng = np.random.default_rng(0)
    experts, hidden, inner = 8, 64, 32
    x, logits = ir.val("x", ir.DataType.FLOAT, ["t", hidden]), ir.val("logits", ir.DataType.FLOAT, ["t", experts])
    weights = [ir.Value(name=name, const_value=ir.tensor(rng.normal(0, 0.1, shape).astype(np.float32)))
               for name, shape in (("gate_up", (experts, 2 * inner, hidden)), ("down", (experts, hidden, inner)))]
    for weight in weights:
        weight.shape, weight.type = weight.const_value.shape, ir.TensorType(ir.DataType.FLOAT)
    node = ir.node("MoE", [x, logits, *weights], {"k": 2, "normalize_routing_weights": 1}, domain="dflash")
    node.outputs[0].name = "y"
    graph = ir.Graph([x, logits], node.outputs, nodes=[node], initializers=weights, opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    add_moe_function(model)
    if fused:
        fuse(model, PassContext("moe-fusion", "target", None, {}))
    return model


def _run(model: ir.Model, x: np.ndarray, logits: np.ndarray) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x, "logits": logits})


def test_the_fused_kernel_equals_the_exported_function_and_pairing_makes_rows_independent():
    rng = np.random.default_rng(1)
    x, logits = rng.normal(0, 1, (16, 64)).astype(np.float32), rng.normal(0, 1, (16, 8)).astype(np.float32)
    reference = _run(_moe_graph(False), x, logits)[0]  # every expert computed, weighted by the routing
    fused = _moe_graph(True)
    whole = _run(fused, x, logits)[0]
    np.testing.assert_allclose(whole, reference, rtol=0, atol=1e-5)
    alone = np.concatenate([_run(fused, x[i : i + 1], logits[i : i + 1])[0] for i in range(16)])
    np.testing.assert_array_equal(alone, whole)
    split = np.concatenate([_run(fused, x[a:b], logits[a:b])[0] for a, b in ((0, 3), (3, 4), (4, 9), (9, 16))])
    np.testing.assert_array_equal(split, whole)


def test_int4_quantizes_the_experts_into_qmoe_and_the_routers_stay_float(moe, tmp_path):
    quantized = tmp_path / "int4"
    _, report = apply_pipeline(moe.out, ["int4"], quantized, {"int4": {"block_size": "32"}}, progress=False)
    target = next(row["details"] for row in report if row["graph"] == "target")
    assert target["quantized_moe"] == moe.spec.target_layers
    ops = _ops(quantized / "target.onnx")
    assert ops.count(("com.microsoft", "QMoE")) == 4 and ("dflash", "MoE") not in ops
    graph = onnx.load(str(quantized / "target.onnx"), load_external_data=False)
    floats = {t.name for t in graph.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    routers = [n.input[1] for n in graph.graph.node if n.op_type == "Gemm" and n.input[1] in floats]
    assert routers == [f"lm.model.layers.{i}.mlp.gate.weight" for i in range(4)]  # they choose the experts
    qmoe = next(n for n in graph.graph.node if n.op_type == "QMoE")
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in qmoe.attribute}
    assert attributes["expert_weight_bits"] == 4 and attributes["block_size"] == 32
    assert attributes["accuracy_level"] == 4  # int8 activations, as the MatMulNBits of the pass
    shapes = {t.name: list(t.dims) for t in graph.graph.initializer}
    assert shapes[qmoe.input[2]] == [8, 128, 32] and shapes[qmoe.input[3]] == [8, 128, 2]  # fc1: 2I rows, H/2 bytes
    # the float export's logits, and the quantized graph's DFlash tokens equal to its own greedy ones
    lowered = tmp_path / "ort"
    lower_ort(quantized, lowered, OrtOptions(ctx_len=256), QUIET)
    decoder, reference = open_decoder(lowered), open_decoder(quantized)
    for prompt in PROMPTS:
        want = reference.generate(prompt, 20, "greedy", stop_token_ids=[]).tokens
        assert decoder.generate(prompt, 20, "dflash", stop_token_ids=[]).tokens == want
    from test_ort_lowering import _assert_batch_invariant

    _assert_batch_invariant(decoder)


def test_experts_too_narrow_for_the_block_stay_in_float_with_the_reason(moe, tmp_path):
    _, report = apply_pipeline(moe.out, ["int4"], tmp_path / "int4", {"int4": {"block_size": "128"}},
                               progress=False)
    target = next(row["details"] for row in report if row["graph"] == "target")
    assert "quantized_moe" not in target
    assert sum("not multiples of block 128" in why for why in target["not_quantized"].values()) == 4
    assert _ops(tmp_path / "int4" / "target.onnx").count(("dflash", "MoE")) == 4


@pytest.mark.parametrize("backend", ["mlx", "ai100", "coreml"])
def test_the_other_lowerings_refuse_experts_in_one_line(backend, moe, tmp_path, capsys):
    code = main(["lower", str(moe.out), "--target", backend, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len([line for line in err if "error" in line]) == 1, err
    assert "mixture-of-experts layers (8 experts, 2 per token)" in err[-1] and "--target ort" in err[-1]
    assert not (tmp_path / "out").exists()


def test_moe_families_pass_the_architecture_check_and_others_do_not():
    from transformers import CONFIG_MAPPING

    from exporter.architectures import check_architecture

    for family in ("qwen3_moe", "qwen2_moe", "qwen3_5_moe", "qwen3_next"):
        check_architecture(CONFIG_MAPPING[family](), family)
    with pytest.raises(DFlashError, match="mixtral model with mixture-of-experts layers"):
        check_architecture(CONFIG_MAPPING["mixtral"](), "mixtral")


# shared experts: every token also runs one MLP, gated by sigmoid(Linear(hidden, 1)) (Qwen2-MoE, and Qwen3.5-MoE and
# Qwen3-Next, whose other layers are Gated-DeltaNet linear attention)
SHARED_EXPERT_PAIRS = {
    "qwen2_moe": TinySpec(model_type="qwen2_moe", num_experts=8, experts_per_token=2,
                          shared_expert_intermediate_size=96, agree=True, tie_embeddings=False, block_size=4,
                          target_layer_ids=[1, 2], seed=13),
    # Qwen3-Next (Qwen3-Coder-Next): a hybrid whose linear layers project q, k, v, z and b, a interleaved; the same
    # HybridTarget + shared-expert path as Qwen3.5-MoE (run by hand on 2026-12-02: parity and ORT tokens == HF greedy)
    "qwen3_next": TinySpec(model_type="qwen3_next", num_experts=8, experts_per_token=2,
                           shared_expert_intermediate_size=96, full_attention_interval=2, tie_embeddings=False,
                           block_size=4, target_layer_ids=[1, 2], seed=17),
}


@pytest.mark.parametrize("family", sorted(SHARED_EXPERT_PAIRS))
def test_shared_expert_families_export_lower_and_decode_hf_greedy(family, tmp_path):
    """Export against transformers' own class (parity: logits, K/V, state, DFlash tokens == HF greedy), then the
    ORT lowering: the routed experts as com.microsoft MoE, the shared expert as plain ops, tokens == HF greedy."""
    from dflash_onnx.parity import run_parity
    from exporter.export import export_pair

    spec = SHARED_EXPERT_PAIRS[family]
    target, draft = build_pair(spec, tmp_path)
    manifest = export_pair(target, draft, tmp_path / "out", progress=False)
    assert manifest.experts["shared_intermediate_size"] == 96
    assert _ops(tmp_path / "out" / "target.onnx").count(("dflash", "MoE")) == spec.target_layers
    report = run_parity(tmp_path / "out", num_prompts=2, max_new_tokens=16)
    assert report.ok, [c for c in report.checks if not c.ok]
    lower_ort(tmp_path / "out", tmp_path / "ort", OrtOptions(ctx_len=256), QUIET)
    assert _ops(tmp_path / "ort" / "target.onnx").count(("com.microsoft", "MoE")) == spec.target_layers
    lm, decoder = load_target(target), open_decoder(tmp_path / "ort")
    for prompt in PROMPTS:
        want = hf_greedy(lm, prompt, 16, None)
        assert decoder.generate(prompt, 16, "dflash", stop_token_ids=[]).tokens == want
        assert decoder.generate(prompt, 16, "greedy", stop_token_ids=[]).tokens == want
