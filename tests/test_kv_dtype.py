"""`lower --target ort --kv-dtype int8`: the target's K/V buffers int8, ONNX Runtime's quantized GroupQueryAttention
cache with per-channel scales calibrated at lowering (issue 56). DFlash reads the same cache greedy does, so its
tokens stay greedy's within the lowering; against float K/V the lowering is the float graph computing on K/V
rounded to the int8 grid of its scales, which bounds how far its logits move from float K/V's."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from spread import varied_prompts

from dflash_onnx.cli import main
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets import LowerRequest, open_decoder
from dflash_onnx.targets.check import compare_lowering
from dflash_onnx.targets.ort.check import LOWERING_TOLERANCE, float_cache, with_float_cache
from dflash_onnx.targets.ort.lower import lower_ort
from dflash_onnx.targets.ort.options import OrtOptions
from dflash_onnx.targets.ort.session import open_session

PAIR = "varied_b4"  # a pair whose greedy output depends on the whole prompt, its draft right at some positions only
QUIET = LowerRequest(progress=False)


@pytest.fixture(scope="module")
def int8(exported, tmp_path_factory):
    """The int8 lowering of PAIR (spinning fixed: the mode's measurement is not what this file tests)."""
    out = tmp_path_factory.mktemp("kv_int8") / PAIR
    lower_ort(exported(PAIR).out, out, OrtOptions(ctx_len=512, kv_dtype="int8", spinning="on"), QUIET)
    return out


@pytest.mark.parametrize("options, says", [
    (dict(kv_buffer=False), "drop --kv-buffer off"),
    (dict(kv_attention="ragged"), "use --kv-attention gqa"),
    (dict(provider="cuda"), "lower with --provider cpu"),
    (dict(kv_dtype="int4"), "choose one of auto, float32, float16, int8"),
])
def test_bad_combinations_are_refused_in_one_line(options, says):
    with pytest.raises(DFlashError, match=says) as refused:
        OrtOptions(**{"kv_dtype": "int8", **options}).validate(4)
    assert "\n" not in str(refused.value)


def test_the_cli_refuses_before_any_work(exported, tmp_path, capsys):
    source = exported(PAIR).out
    code = main(["lower", str(source), "--target", "ort", "--kv-dtype", "int8", "--kv-buffer", "off",
                 "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "drop --kv-buffer off" in err, err
    # a float16 cache under float32 queries: ORT's CPU kernel attends a call's own new rows unrounded
    with pytest.raises(DFlashError, match="unrounded"):
        lower_ort(source, tmp_path / "b", OrtOptions(kv_dtype="float16"), QUIET)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_lowering_records_its_int8_cache(int8):
    manifest = load_manifest(int8)
    assert manifest.dtype == "float32" and manifest.target.kv_dtype == "int8"
    assert manifest.lowering.options["kv_dtype"] == "int8"
    assert manifest.lowering.rewrites["kv-buffer"]["target"]["kv_dtype"] == "int8"
    report = manifest.lowering.report["kv_int8"]
    assert report["calibration"]["target_calls"] > 0 and 0 < report["key_scales"][0] <= report["key_scales"][1]
    graph = onnx.load(str(int8 / manifest.target.file), load_external_data=False).graph
    attentions = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attentions) == manifest.target.num_layers
    for node in attentions:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["k_quant_type"] == attributes["v_quant_type"] == b"PER_CHANNEL"
        assert attributes["kv_cache_bit_width"] == 8 and all(node.input[12:14])
    decoder = open_decoder(int8)
    decoder.generate([5, 6, 7, 8, 9], 8, "dflash", stop_token_ids=[])
    buffers = decoder.target.kv_buffers()
    assert {b.dtype for b in buffers.values()} == {np.dtype(np.int8)}
    assert all(np.abs(b[:, :, :12].astype(int)).max() > 64 for b in buffers.values())  # the scales are used


def test_dflash_tokens_are_greedy_within_the_int8_lowering(int8):
    decoder = open_decoder(int8)
    prompts = varied_prompts(decoder.manifest.vocab_size, 4, seed=3, shortest=2, longest=12)
    for prompt in prompts:  # full blocks: every step verifies, and rolls back, proposals
        want = decoder.generate(prompt, 32, "greedy", stop_token_ids=[]).tokens
        assert decoder.generate(prompt, 32, "dflash", stop_token_ids=[]).tokens == want
        assert decoder.generate(prompt, 32, "dflash", stop_token_ids=[], verify="full").tokens == want


def rounded_kv(graph: onnx.ModelProto, manifest) -> onnx.ModelProto:
    """The int8 lowering's target computing in float as its int8 cache does: each layer's new K and V rows rounded
    to the int8 grid of its scales (QuantizeLinear, DequantizeLinear; K rotated first where GroupQueryAttention
    rotated it: the rotation moves outside, the same com.microsoft kernel), then attended over float buffers."""
    nodes, added = [], []
    for node in graph.node:
        attributes = {a.name: a for a in node.attribute}
        if node.op_type != "GroupQueryAttention" or "k_quant_type" not in attributes:
            nodes.append(node)
            continue
        layer = node.name
        heads, kv_heads = attributes["num_heads"].i, attributes["kv_num_heads"].i
        query, key, value = node.input[0], node.input[1], node.input[2]
        if "do_rotary" in attributes and attributes["do_rotary"].i:
            cos, sin = node.input[7], node.input[8]
            for name, count in ((query, heads), (key, kv_heads)):
                nodes.append(helper.make_node("RotaryEmbedding", [name, "position_ids", cos, sin],
                                              [f"{name}_rotated_{layer}"], domain="com.microsoft", num_heads=count,
                                              interleaved=0))
            query, key = f"{query}_rotated_{layer}", f"{key}_rotated_{layer}"
            attributes["do_rotary"].i = 0
            node.input[7], node.input[8] = "", ""
        rounded = []
        for name, scale in ((key, node.input[12]), (value, node.input[13])):
            flat, zero = f"{scale}_flat", f"{scale}_zero"
            width = int(np.prod([d for d in next(t for t in graph.initializer if t.name == scale).dims]))
            added += [helper.make_tensor(zero, onnx.TensorProto.INT8, [width], np.zeros(width, np.int8)),
                      helper.make_tensor(f"{flat}_shape", onnx.TensorProto.INT64, [1], [width])]
            nodes += [helper.make_node("Reshape", [scale, f"{flat}_shape"], [flat]),
                      helper.make_node("QuantizeLinear", [name, flat, zero], [f"{name}_q_{layer}"], axis=2),
                      helper.make_node("DequantizeLinear", [f"{name}_q_{layer}", flat, zero],
                                       [f"{name}_rounded_{layer}"], axis=2)]
            rounded.append(f"{name}_rounded_{layer}")
        node.input[0], node.input[1], node.input[2] = query, *rounded
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(added)
    return graph


def test_the_int8_cache_is_float_kv_rounded_to_its_grid(int8, ort_lowered, record_property):
    """The int8 lowering's outputs equal, to the lowering tolerance, the same graph's in float on K/V rounded to
    the grid of its scales: its difference from float K/V is that rounding's, nothing else (the bound reported, and
    recorded by the lowering). Greedy tokens against the float lowering: their agreement reported."""
    manifest = load_manifest(int8)
    floats = with_float_cache(manifest)
    path = int8 / manifest.target.file

    def structure(rounded: bool):
        graph = onnx.load(str(path), load_external_data=False)
        if rounded:
            rounded_kv(graph.graph, manifest)
        return float_cache(graph, manifest)

    def opener(kind: str):
        if kind == "int8":
            return lambda graph: open_session(int8, manifest, graph)
        return lambda graph: open_session(int8, floats, graph, structure=structure(kind == "rounded")
                                          if graph == "target" else None)

    def target(differences) -> float:
        return max(d for name, d in differences if name.startswith("target"))

    against_rounded = target(compare_lowering(floats, opener("rounded"), opener("int8"), manifest).differences)
    rounding = target(compare_lowering(floats, opener("float"), opener("rounded"), floats).differences)
    assert against_rounded <= LOWERING_TOLERANCE["float32"], against_rounded
    recorded = manifest.lowering.report["kv_int8"]["max_relative_difference"]
    assert abs(recorded - rounding) <= against_rounded + LOWERING_TOLERANCE["float32"], (recorded, rounding)

    quantized, plain = open_decoder(int8), open_decoder(ort_lowered(PAIR))
    prompts = varied_prompts(manifest.vocab_size, 6, seed=5, shortest=2, longest=24)
    outputs = [(quantized.generate(p, 32, "greedy", stop_token_ids=[]).tokens,
                plain.generate(p, 32, "greedy", stop_token_ids=[]).tokens) for p in prompts]
    same = sum(a == b for a, b in outputs)
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in outputs]
    record_property("int8_vs_float_kv", {"rounding_relative_difference": rounding, "int8_vs_rounded": against_rounded,
                                         "identical_outputs": f"{same}/{len(outputs)}", "common_prefix": prefix})
    print(f"int8 K/V vs float K/V: logits and hidden within {rounding:.3g} of their scale (K/V rounding; int8 vs the "
          f"rounded float graph {against_rounded:.2g}); greedy outputs identical {same}/{len(outputs)}, common "
          f"prefixes {prefix} of 32")
