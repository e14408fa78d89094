"""The compiler's float16, emulated: AI 100 graphs rounded as `-convert-to-fp16` would round them hold their
K/V, logits and greedy tokens at every position; the failure modes they avoid (in-graph rotary angles, RMSNorm's
x^2) do fail under the same emulation."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from dflash_onnx.exporter.export import export_program
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets import LowerRequest
from dflash_onnx.targets.ai100.emulate import GraphSession, emulated_graph
from dflash_onnx.targets.ai100.lower import lower_ai100
from dflash_onnx.targets.ai100.options import Ai100Options
from dflash_onnx.targets.ai100.precision import norm_outputs


@pytest.fixture(scope="module")
def long_lowering(exported, tmp_path_factory):
    """agree_b2 lowered at ctx_len 4096 (dry run): the emulation probes positions up to 4093."""
    out = tmp_path_factory.mktemp("ai100_long") / "ai"
    lower_ai100(exported("agree_b2").out, out, Ai100Options(ctx_len=4096, prefill_len=4, dry_run=True),
                LowerRequest(progress=False))
    return out


def _report(directory):
    return load_manifest(directory).lowering.report["fp16_emulation"]


@pytest.mark.parametrize("name", ["agree_b8", "long"])
def test_emulated_float16_holds_kv_logits_and_tokens_up_to_ctx_len(lowered, long_lowering, name):
    directory = long_lowering if name == "long" else lowered(name)[0]
    manifest = load_manifest(directory)
    report = _report(directory)
    for graph, curve in report["curves"].items():
        assert curve[-1]["position"] + manifest.block_size == manifest.ctx_len - 1  # the last block that fits
        for probe in curve:
            assert max(probe["k"], probe["v"]) < 5e-3, (graph, probe)
            assert probe["logits"] < 2e-2 and probe["argmax_agree"] >= 0.99, (graph, probe)
            assert probe.get("context", 0.0) < 5e-3
    decode = report["decode"]
    assert decode["greedy_identical"] == decode["dflash_identical"] == decode["prompts"] == 2
    assert decode["last_position"] >= manifest.ctx_len - manifest.block_size - 4


def test_float16_graphs_need_no_emulation(lowered):
    assert "float16 already" in _report(lowered("agree_b4_fp16")[0])["skipped"]


def test_in_graph_rotary_angles_fail_the_same_emulation(exported):
    """The export computes `position * inv_freq -> Cos/Sin` in the graph: rounded to float16, the K it writes
    drifts with the position (what the rotary tables of the AI 100 graphs avoid)."""
    pair = exported("agree_b2")
    manifest = load_manifest(pair.out)
    model = onnx.load(str(pair.out / manifest.target.file), load_external_data=False)
    exact = GraphSession(emulated_graph(model, set(), round_to_fp16=False), pair.out, "export.fp32")
    device = GraphSession(emulated_graph(model, set()), pair.out, "export.fp16")
    spec = manifest.target
    empty = {name: np.zeros((1, 0, spec.num_kv_heads, spec.head_dim), np.float32) for name in spec.kv_inputs}
    errors = {}
    for position in (0, 3000):
        feeds = {"input_ids": np.array([[5, 9]]), "position_ids": np.array([[position, position + 1]]), **empty}
        key = spec.kv_outputs[0]
        want, got = exact.run(feeds, [key])[key], device.run(feeds, [key])[key]
        errors[position] = float(np.abs(got - want).max() / np.abs(want).max())
    assert errors[0] < 5e-3 and errors[3000] > 20 * errors[0]


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        self.norm = Qwen3RMSNorm(64, eps=1e-6)

    def forward(self, x):
        y = self.norm(x)
        return y, torch.argmax(y, dim=-1)


def test_rmsnorm_x_squared_overflows_float16_unless_the_plan_keeps_it_float32(tmp_path):
    program = export_program(_Norm().eval(), (torch.randn(1, 3, 64),), ["x"], ["y", "ids"], None, 18)
    program.save(str(tmp_path / "norm.onnx"))
    model = onnx.load(str(tmp_path / "norm.onnx"))
    plan = set(norm_outputs(model))
    assert plan and {n.op_type for n in model.graph.node if set(n.output) & plan} >= {"Pow", "ReduceMean"}
    x = np.random.default_rng(0).normal(size=(1, 3, 64)).astype(np.float32) * 300  # |x| past 256
    exact = GraphSession(emulated_graph(model, set(), round_to_fp16=False), tmp_path, "exact").run({"x": x}, ["y"])
    unplanned = GraphSession(emulated_graph(model, set()), tmp_path, "bare").run({"x": x}, ["y"])
    planned = GraphSession(emulated_graph(model, plan), tmp_path, "plan").run({"x": x}, ["y"])
    assert np.abs(unplanned["y"]).max() < 1e-3 * np.abs(exact["y"]).max()  # inf mean -> rsqrt 0 -> all zeros
    np.testing.assert_allclose(planned["y"], exact["y"], rtol=2e-3, atol=2e-3)
