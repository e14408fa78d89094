"""rope-fusion rules, each on its own small graph shaped like the exporter's output, then on exported pairs."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from passtools import apply_pass

from dflash_onnx.passes.pipeline import apply_pipeline
from dflash_onnx.passes.rope_fusion import FORMS, run
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest

HEADS, HEAD_DIM, CONTEXT, BLOCK = 3, 8, 5, 4
MAX_INT64 = 2**63 - 1


def _rotation_graph(layout: str, streams: bool, split: int = HEAD_DIM // 2, sin_start: str = "ctx",
                    half_precision: bool = False) -> onnx.ModelProto:
    """Two rotations (like q and k) of x by angles [1, positions, HEAD_DIM/2], as torch.onnx exports them.

    layout "bnsh" rotates [batch, heads, seq, head_dim] (HF targets), "bsnh" [batch, seq, heads, head_dim]
    (the draft). With `streams`, x1 is rotated at the context positions and x2 at the block positions,
    cos/sin being sliced along the sequence axis at the dynamic split `ctx` (the draft's two streams).
    `half_precision`: x is float16 and cos/sin are cast after float32 trigonometry (float16 exports).
    """
    ints = {"zero": [0], "split": [split], "end": [MAX_INT64], "last": [3], "one": [1], "seq": [1],
            "heads_axis": [1 if layout == "bnsh" else 2]}
    initializers = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()]
    nodes = [helper.make_node("Concat", ["angles", "angles"], ["doubled"], axis=-1),
             helper.make_node("Cos", ["doubled"], ["cos32" if half_precision else "cos"]),
             helper.make_node("Sin", ["doubled"], ["sin32" if half_precision else "sin"])]
    if half_precision:
        nodes += [helper.make_node("Cast", ["cos32"], ["cos"], to=TensorProto.FLOAT16),
                  helper.make_node("Cast", ["sin32"], ["sin"], to=TensorProto.FLOAT16)]
    stream_of = {"x1": ("zero", "ctx"), "x2": ("ctx", "end")} if streams else {"x1": None, "x2": None}
    for x, bounds in stream_of.items():
        cos, sin = "cos", "sin"
        if bounds:
            cos, sin = f"cos_{x}", f"sin_{x}"
            sin_bounds = bounds if sin_start == "ctx" else ("zero", "end")
            nodes += [helper.make_node("Slice", ["cos", *bounds, "seq", "one"], [cos]),
                      helper.make_node("Slice", ["sin", *sin_bounds, "seq", "one"], [sin])]
        nodes += [
            helper.make_node("Unsqueeze", [cos, "heads_axis"], [f"{x}_cos"]),
            helper.make_node("Unsqueeze", [sin, "heads_axis"], [f"{x}_sin"]),
            helper.make_node("Slice", [x, "zero", "split", "last", "one"], [f"{x}_low"]),
            helper.make_node("Slice", [x, "split", "end", "last", "one"], [f"{x}_high"]),
            helper.make_node("Neg", [f"{x}_high"], [f"{x}_neg"]),
            helper.make_node("Concat", [f"{x}_neg", f"{x}_low"], [f"{x}_rotated"], axis=-1),
            helper.make_node("Mul", [x, f"{x}_cos"], [f"{x}_a"]),
            helper.make_node("Mul", [f"{x}_rotated", f"{x}_sin"], [f"{x}_b"]),
            helper.make_node("Add", [f"{x}_a", f"{x}_b"], [f"{x}_out"]),
        ]

    def x_info(name, seq):
        shape = [1, HEADS, seq, HEAD_DIM] if layout == "bnsh" else [1, seq, HEADS, HEAD_DIM]
        return helper.make_tensor_value_info(name, TensorProto.FLOAT16 if half_precision else TensorProto.FLOAT, shape)

    inputs = [x_info("x1", CONTEXT if streams else "seq"), x_info("x2", BLOCK if streams else "seq"),
              helper.make_tensor_value_info("angles", TensorProto.FLOAT, [1, "positions", HEAD_DIM // 2])]
    if streams:
        inputs.append(helper.make_tensor_value_info("ctx", TensorProto.INT64, [1]))
    dtype = TensorProto.FLOAT16 if half_precision else TensorProto.FLOAT
    outputs = [helper.make_tensor_value_info(f"{x}_out", dtype, None) for x in ("x1", "x2")]
    graph = helper.make_graph(nodes, "rope", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _feeds(layout: str, streams: bool, half_precision: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    seq1, seq2 = (CONTEXT, BLOCK) if streams else (6, 6)
    positions = CONTEXT + BLOCK if streams else 6

    def x(seq):
        shape = (1, HEADS, seq, HEAD_DIM) if layout == "bnsh" else (1, seq, HEADS, HEAD_DIM)
        return rng.standard_normal(shape).astype(np.float16 if half_precision else np.float32)

    inv_freq = 1.0 / 10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    feeds = {"x1": x(seq1), "x2": x(seq2),
             "angles": (np.arange(positions)[None, :, None] * inv_freq).astype(np.float32)}
    if streams:
        feeds["ctx"] = np.array([CONTEXT])
    return feeds


def _run(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _ops(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op_type]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layout, streams", [("bnsh", False), ("bsnh", True), ("bnsh", True), ("bsnh", False)])
def test_each_rotation_becomes_one_op_with_cos_sin_once_per_stream(form, layout, streams):
    model = _rotation_graph(layout, streams)
    fused, details = apply_pass(run, model, "draft", {"form": form})
    assert details["fused"] == details["rotations"] == 2 and details["unmatched"] in ([], 0)
    assert len(_ops(fused, "Cos")) == len(_ops(fused, "Sin")) == (2 if streams else 1)
    if form == "hoist":
        assert not _ops(fused, "RotaryEmbedding")
    else:
        rotary = _ops(fused, "RotaryEmbedding")
        assert len(rotary) == 2 and not _ops(fused, "Neg")
        assert {n.domain for n in rotary} == {"com.microsoft" if form == "com.microsoft" else ""}
    if form == "onnx":
        assert {o.version for o in fused.opset_import if o.domain in ("", "ai.onnx")} == {23}
    feeds = _feeds(layout, streams)
    for got, want in zip(_run(fused, feeds), _run(model, feeds)):
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("form", FORMS)
def test_float16_rotations_with_cast_cos_sin_are_fused(form):
    model = _rotation_graph("bsnh", True, half_precision=True)
    fused, details = apply_pass(run, model, "draft", {"form": form})
    assert details["fused"] == 2 and len(_ops(fused, "Cos")) == 2
    feeds = _feeds("bsnh", True, half_precision=True)
    for got, want in zip(_run(fused, feeds), _run(model, feeds)):
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=2e-3)


def test_a_split_off_the_middle_is_not_a_rotation_and_is_reported():
    model = _rotation_graph("bnsh", False, split=HEAD_DIM // 2 - 1)
    fused, details = apply_pass(run, model, "target", {"form": "com.microsoft"})
    assert details["fused"] == 0 and len(details["unmatched"]) == 2 and not _ops(fused, "RotaryEmbedding")


def test_cos_and_sin_of_different_streams_are_left_alone():
    fused, details = apply_pass(run, _rotation_graph("bsnh", True, sin_start="zero"), "draft", {"form": "onnx"})
    assert details["fused"] == 0 and not _ops(fused, "RotaryEmbedding")


def test_unknown_form_is_refused():
    with pytest.raises(DFlashError, match="choose from com.microsoft, onnx, hoist"):
        apply_pass(run, _rotation_graph("bnsh", False), "target", {"form": "mlx"})


@pytest.mark.parametrize("pair", ["agree_b8", "llama_sliding_b16", "agree_b4_fp16"])
@pytest.mark.parametrize("form", FORMS)
def test_exported_graphs_fuse_every_rotation(pair, form, exported, tmp_path):
    """Target: q and k per layer on one cos/sin; draft: block q, context k and block k per layer on two."""
    source = exported(pair)
    out = tmp_path / "fused"
    apply_pipeline(source.out, ["rope-fusion"], out, {"rope-fusion": {"form": form}}, progress=False)
    report = {r["graph"]: r["details"] for r in json.loads((out / "passes_report.json").read_text())}
    expected = {"target": 2 * source.spec.target_layers, "draft": 3 * source.spec.draft_layers}
    streams = {"target": 1, "draft": 2}
    for graph in ("target", "draft"):
        model = onnx.load(str(out / f"{graph}.onnx"), load_external_data=False)
        assert report[graph]["fused"] == report[graph]["rotations"] == expected[graph], graph
        assert len(_ops(model, "Cos")) == len(_ops(model, "Sin")) == streams[graph], graph
        assert len(_ops(model, "RotaryEmbedding")) == (0 if form == "hoist" else expected[graph]), graph
        if form != "hoist":
            assert not _ops(model, "Neg"), graph
    assert load_manifest(out).passes[0]["options"] == {"form": form}
