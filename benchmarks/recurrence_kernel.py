"""The Gated-DeltaNet recurrence alone, on ONNX Runtime's CPU provider: our export's token `Scan`
(dflash_onnx/exporter/models/linear_attention.py) against ONNX Runtime's fused `com.microsoft::GatedDeltaNet` kernel,
for one
layer's state at 1, 2 and 16 tokens per call (a decode, a decode padded to 2 rows, a 16-token verify).

Both run the same recurrence token after token from the same state; the figure is the minimum over repeats, the
two interleaved, on 2 threads. Prints the table in the docs' format.

    python benchmarks/recurrence_kernel.py [--heads 16] [--dim 128] [--repeats 40]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper
from torch._higher_order_ops.scan import scan

from dflash_onnx.exporter.models.linear_attention import _token_operands, _token_step
from dflash_onnx.figures import markdown_table, provenance

TOKENS = (1, 2, 16)


class TokenScan(torch.nn.Module):
    """One layer's recurrence exactly as the export writes it."""

    def forward(self, state, decay, key, value, beta, query):
        end, (out, _) = scan(_token_step, state, _token_operands(decay, key, value, beta, query))
        return end, out


def _session(model: bytes | str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.log_severity_level = 4
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def ours(heads: int, dim: int, work: Path) -> ort.InferenceSession:
    example = [torch.zeros(1, heads, dim, dim), torch.ones(1, 2, heads), torch.zeros(1, 2, heads, dim),
               torch.zeros(1, 2, heads, dim), torch.zeros(1, 2, heads), torch.zeros(1, 2, heads, dim)]
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    path = work / "scan.onnx"
    torch.onnx.export(TokenScan(), tuple(example), str(path), dynamo=True, opset_version=18, verbose=False,
                      input_names=["state", "decay", "key", "value", "beta", "query"],
                      dynamic_shapes=[None, *({1: tokens},) * 5])
    return _session(str(path))


def fused(heads: int, dim: int) -> ort.InferenceSession:
    """com.microsoft::GatedDeltaNet in its rank-4 spelling: q, k, v [B, S, H, D], decay and beta [B, S, H], the
    state [B, H, Dv, Dk]."""
    def value(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    node = helper.make_node("GatedDeltaNet", ["query", "key", "value", "", "decay", "beta", "state"],
                            ["output", "final_state"], domain="com.microsoft", update_rule="gated_delta", scale=1.0)
    inputs = [value("query", [1, "S", heads, dim]), value("key", [1, "S", heads, dim]),
              value("value", [1, "S", heads, dim]), value("decay", [1, "S", heads]), value("beta", [1, "S", heads]),
              value("state", [1, heads, dim, dim])]
    graph = helper.make_graph([node], "gated_delta_net", inputs, [value("output", None), value("final_state", None)])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    return _session(model.SerializeToString())


def feeds(heads: int, dim: int, tokens: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(tokens)
    return {"state": rng.standard_normal((1, heads, dim, dim)).astype(np.float32) * 0.1,
            "decay": rng.uniform(0.9, 1.0, (1, tokens, heads)).astype(np.float32),
            "key": rng.standard_normal((1, tokens, heads, dim)).astype(np.float32) * 0.1,
            "value": rng.standard_normal((1, tokens, heads, dim)).astype(np.float32),
            "beta": rng.uniform(0.0, 1.0, (1, tokens, heads)).astype(np.float32),
            "query": rng.standard_normal((1, tokens, heads, dim)).astype(np.float32) * 0.1}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=16, help="value heads of the layer (Qwen3.5-4B: 32)")
    parser.add_argument("--dim", type=int, default=128, help="key and value head size")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        sessions = {"export's Scan": ours(args.heads, args.dim, Path(work)),
                    "com.microsoft::GatedDeltaNet": fused(args.heads, args.dim)}
        best = {(name, tokens): float("inf") for name in sessions for tokens in TOKENS}
        for tokens in TOKENS:
            given = feeds(args.heads, args.dim, tokens)
            for session in sessions.values():
                wanted = {i.name for i in session.get_inputs()}
                session.run(None, {k: v for k, v in given.items() if k in wanted})  # warm-up
            for _ in range(args.repeats):  # interleaved: noise hits both alike
                for name, session in sessions.items():
                    wanted = {i.name for i in session.get_inputs()}
                    started = time.perf_counter()
                    session.run(None, {k: v for k, v in given.items() if k in wanted})
                    best[name, tokens] = min(best[name, tokens], time.perf_counter() - started)
    rows = [[name, *(f"{1000 * best[name, tokens]:.2f}" for tokens in TOKENS),
             f"{best[name, 16] / best[name, 2]:.1f}x"] for name in sessions]
    print(markdown_table([f"one layer, {args.heads} x {args.dim} x {args.dim} state, ms", "1 token", "2 tokens",
                          "16 tokens", "16 / 2"], rows))
    print()
    print(provenance())


if __name__ == "__main__":
    main()
