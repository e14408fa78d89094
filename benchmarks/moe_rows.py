"""One mixture-of-experts layer on ONNX Runtime's CPU provider, int4 (QMoE, int8 activations): the kernel routing
each token to its k experts itself (the tokens' rows paired, the form the ORT lowering used before), against the
rows the lowering gives it now (passes/experts.py: one paired row per token and chosen expert, k=1, the graph
weighting and adding the k results in rank order), at 1, 2 and 16 tokens per call.

Both come from one dflash::MoE node over the same random weights quantized by the int4 pass's code. Besides the
time (minimum over repeats, the two interleaved, 2 threads), the table says whether each token's result is the
same bits alone as inside a 16-token call. Prints the table in the docs' format.

    python benchmarks/moe_rows.py [--hidden 2880] [--intermediate 2880] [--experts 32] [--per-token 4]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

from dflash_onnx.exporter.models.experts import add_moe_function
from dflash_onnx.figures import markdown_table, provenance
from dflash_onnx.passes import experts

TOKENS = (1, 2, 16)
BLOCK = 64


def expanded(hidden: int, intermediate: int, count: int, per_token: int) -> onnx.ModelProto:
    """A dflash::MoE layer of random weights through the int4 pass's expert quantization."""
    rng = np.random.default_rng(0)
    x = ir.val("x", ir.DataType.FLOAT, ["t", hidden])
    logits = ir.val("logits", ir.DataType.FLOAT, ["t", count])
    weights = []
    for name, shape in (("gate_up", (count, 2 * intermediate, hidden)), ("down", (count, hidden, intermediate))):
        value = ir.Value(name=name, const_value=ir.tensor(rng.normal(0, 0.02, shape).astype(np.float32)))
        value.shape, value.type = value.const_value.shape, ir.TensorType(ir.DataType.FLOAT)
        weights.append(value)
    node = ir.node("MoE", [x, logits, *weights], {"k": per_token, "normalize_routing_weights": 1}, domain="dflash")
    node.outputs[0].name = "y"
    model = ir.Model(ir.Graph([x, logits], node.outputs, nodes=[node], initializers=weights,
                              opset_imports={"": 18}), ir_version=10)
    add_moe_function(model)
    config = DefaultWeightOnlyQuantConfig(block_size=BLOCK, is_symmetric=True, accuracy_level=4, bits=4)
    experts.quantize(model, 4, BLOCK, DefaultWeightOnlyQuantizer(config), accuracy_level=4)
    for name in [name for name, value in model.graph.initializers.items() if not value.uses()]:
        del model.graph.initializers[name]
    model.opset_imports["com.microsoft"] = 1
    return ir.to_proto(model)


def kernel_routed(model: onnx.ModelProto, per_token: int, hidden: int, count: int) -> onnx.ModelProto:
    """The same QMoE weights, the kernel routing k experts per token itself over each token's row paired."""
    qmoe = next(n for n in model.graph.node if n.op_type == "QMoE")
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in qmoe.attribute if a.name != "k"}
    ints = lambda name, values: onnx.helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values)  # noqa: E731
    nodes = []
    for value, width in (("x", hidden), ("logits", count)):
        nodes += [onnx.helper.make_node("Unsqueeze", [value, "one"], [f"{value}_1"]),
                  onnx.helper.make_node("Expand", [f"{value}_1", "twice"], [f"{value}_2"]),
                  onnx.helper.make_node("Reshape", [f"{value}_2", f"rows_{width}"], [f"{value}_paired"])]
    nodes += [onnx.helper.make_node("QMoE", ["x_paired", "logits_paired", *qmoe.input[2:]], ["y_paired"],
                                    domain="com.microsoft", k=per_token, **attributes),
              onnx.helper.make_node("Reshape", ["y_paired", "pairs"], ["y_pairs"]),
              onnx.helper.make_node("Gather", ["y_pairs", "first"], ["y"], axis=1)]
    constants = [ints("one", [1]), ints("twice", [1, 2, 1]), ints(f"rows_{hidden}", [-1, hidden]),
                 ints(f"rows_{count}", [-1, count]), ints("pairs", [-1, 2, hidden]),
                 onnx.helper.make_tensor("first", onnx.TensorProto.INT64, [], [0])]
    used = [t for t in model.graph.initializer if t.name in qmoe.input]
    graph = onnx.helper.make_graph(nodes, "kernel_routed", list(model.graph.input), list(model.graph.output),
                                   used + constants)
    return onnx.helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=10)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = 2, 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2880, help="gpt-oss-20b: 2880")
    parser.add_argument("--intermediate", type=int, default=2880, help="each expert's (gpt-oss-20b: 2880)")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--per-token", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    ours = expanded(args.hidden, args.intermediate, args.experts, args.per_token)
    sessions = {"kernel routes k per token (paired rows)": _session(kernel_routed(ours, args.per_token, args.hidden,
                                                                                  args.experts)),
                "one paired row per chosen expert (the lowering)": _session(ours)}
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (16, args.hidden)).astype(np.float32)
    logits = rng.normal(0, 1, (16, args.experts)).astype(np.float32)
    best = {(name, tokens): float("inf") for name in sessions for tokens in TOKENS}
    invariant = {}
    for name, session in sessions.items():
        whole = session.run(None, {"x": x, "logits": logits})[0]
        alone = np.concatenate([session.run(None, {"x": x[i:i + 1], "logits": logits[i:i + 1]})[0]
                                for i in range(16)])
        invariant[name] = "yes" if np.array_equal(whole, alone) else f"no ({np.abs(whole - alone).max():.1e})"
    for tokens in TOKENS:
        feeds = {"x": x[:tokens], "logits": logits[:tokens]}
        for _ in range(args.repeats):  # interleaved: noise hits both alike
            for name, session in sessions.items():
                started = time.perf_counter()
                session.run(None, feeds)
                best[name, tokens] = min(best[name, tokens], time.perf_counter() - started)
    first = next(iter(sessions))
    rows = [[name, *(f"{1000 * best[name, tokens]:.2f}" for tokens in TOKENS),
             " / ".join(f"{best[name, t] / best[first, t]:.2f}x" for t in TOKENS), invariant[name]]
            for name in sessions]
    print(markdown_table([f"int4 layer {args.hidden} wide, {args.experts} experts of {args.intermediate}, "
                          f"{args.per_token} per token, ms", *(f"{t} token{'s' * (t > 1)}" for t in TOKENS),
                          "vs kernel routing", "same bits alone as in 16"], rows))
    print()
    print(provenance())


if __name__ == "__main__":
    main()
