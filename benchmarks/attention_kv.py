"""GroupQueryAttention over float32 against float16 K/V on ONNX Runtime's CPU provider: what a float16 cache (half
the bytes a decode step reads for its context) costs or saves. One node per layer as the buffer form runs it (its
K/V buffer read and written in place, RoPE inside, seqlens_k / total_sequence_length), each layer with its own
buffers so the cache streams from memory as in a step; the best of 7 passes over every layer.

    python benchmarks/attention_kv.py [--layers 28 --heads 16 --kv-heads 8 --head-dim 128] [--ctx-len 1024]
        [--contexts 256,900] [--rows 1,16] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from dflash_onnx.figures import markdown_table, provenance

TYPES = {"float32": (TensorProto.FLOAT, np.float32), "float16": (TensorProto.FLOAT16, np.float16)}


def _session(dtype: str, heads: int, kv_heads: int, head_dim: int, ctx_len: int, threads: int):
    elem, array_type = TYPES[dtype]
    inputs = [helper.make_tensor_value_info("query", elem, [1, "rows", heads * head_dim]),
              helper.make_tensor_value_info("key", elem, [1, "rows", kv_heads * head_dim]),
              helper.make_tensor_value_info("value", elem, [1, "rows", kv_heads * head_dim]),
              helper.make_tensor_value_info("past_key", elem, [1, kv_heads, ctx_len, head_dim]),
              helper.make_tensor_value_info("past_value", elem, [1, kv_heads, ctx_len, head_dim]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "rows"])]
    angles = np.arange(ctx_len)[:, None] / 10000 ** (np.arange(head_dim // 2) / (head_dim // 2))
    caches = [helper.make_tensor(name, elem, list(angles.shape), fn(angles).astype(array_type).ravel().tolist())
              for name, fn in (("cos_cache", np.cos), ("sin_cache", np.sin))]
    node = helper.make_node("GroupQueryAttention", ["query", "key", "value", "past_key", "past_value", "seqlens_k",
                                                    "total_sequence_length", "cos_cache", "sin_cache",
                                                    "position_ids"],
                            ["output", "present_key", "present_value"], domain="com.microsoft", num_heads=heads,
                            kv_num_heads=kv_heads, do_rotary=1)
    outputs = [helper.make_tensor_value_info(name, elem, None) for name in ("output", "present_key", "present_value")]
    graph = helper.make_graph([node], "gqa", inputs, outputs, caches)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = threads, 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def layers_ms(dtype: str, layers: int, heads: int, kv_heads: int, head_dim: int, ctx_len: int, context: int,
              rows: int, threads: int) -> float:
    """Milliseconds for one call per layer, each layer's K/V buffers bound in place (the best of 7 passes)."""
    array_type = TYPES[dtype][1]
    session = _session(dtype, heads, kv_heads, head_dim, ctx_len, threads)
    rng = np.random.default_rng(0)
    feeds = {"query": rng.random((1, rows, heads * head_dim)).astype(array_type),
             "key": rng.random((1, rows, kv_heads * head_dim)).astype(array_type),
             "value": rng.random((1, rows, kv_heads * head_dim)).astype(array_type),
             "seqlens_k": np.array([context + rows - 1], np.int32),
             "total_sequence_length": np.array(context + rows, np.int32),
             "position_ids": np.arange(context, context + rows)[None]}
    bindings = []
    for _ in range(layers):
        binding = session.io_binding()
        for past, present in (("past_key", "present_key"), ("past_value", "present_value")):
            buffer = ort.OrtValue.ortvalue_from_numpy(rng.random((1, kv_heads, ctx_len, head_dim)).astype(array_type))
            binding.bind_ortvalue_input(past, buffer)
            binding.bind_ortvalue_output(present, buffer)
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("output", "cpu")
        bindings.append((binding, buffer))
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for binding, _ in bindings:
            session.run_with_iobinding(binding)
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ctx-len", type=int, default=1024, help="rows of each K/V buffer")
    parser.add_argument("--contexts", default="256,900", help="tokens of context, comma-separated")
    parser.add_argument("--rows", default="1,16", help="tokens per call, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    if max(contexts) + max(rows_list) > args.ctx_len:
        parser.error(f"--contexts and --rows reach past --ctx-len {args.ctx_len}")
    table = []
    for context in contexts:
        for rows in rows_list:
            times = [layers_ms(dtype, args.layers, args.heads, args.kv_heads, args.head_dim, args.ctx_len, context,
                               rows, args.threads) for dtype in TYPES]
            table.append([str(context), str(rows), *(f"{t:.2f}" for t in times), f"{times[1] / times[0]:.2f}x"])
    print(markdown_table(["context", "rows", "float32 K/V ms", "float16 K/V ms", "float16 / float32"], table))
    print(f"\n{args.layers} layers, {args.threads} thread(s). {provenance()}")


if __name__ == "__main__":
    main()
