"""One int4 matmul, ONNX Runtime's MatMulNBits against ggml's Q4_0 matmul, at a model's shapes: how fast each kernel
is per call (the weights hot in cache, as both harnesses run them) at 1 and 2 activation rows (`--rows`: others,
e.g. 1,16 for what a verify of 16 tokens costs against a decode step), and what fusing the projections that share an
activation (q/k/v, gate/up: the sibling-matmuls pass) saves.

ggml is timed by llama.cpp's own `test-backend-ops perf` on MUL_MAT cases written to a test file (it runs with
hardware threads / 2; ORT runs with the same count); ORT by MatMulNBits in a one-node graph, blocks of 32,
symmetric, accuracy level 4 (int8 activations, as our int4 pass writes them).

    python benchmarks/matmul_kernels.py [--hidden 1024 --heads 16 --kv-heads 8 --head-dim 128
        --intermediate 3072 --vocab 151936] [--rows 1,2] [--activations float32|float16]
        [--test-backend-ops PATH] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from dflash_onnx.figures import markdown_table, provenance

GGML_OP_MUL_MAT, GGML_TYPE_F32, GGML_TYPE_Q4_0 = 29, 0, 2
Q4_0_BLOCK_BYTES = 18  # 32 weights: 16 bytes of nibbles and a float16 scale


ACTIVATIONS = {"float32": (TensorProto.FLOAT, np.float32), "float16": (TensorProto.FLOAT16, np.float16)}


def _session(widths: list[int], k: int, threads: int, block: int = 32,
             activations: str = "float32") -> ort.InferenceSession:
    """MatMulNBits per width over one activation; its scales take the activations' type, as the op requires."""
    elem, dtype = ACTIVATIONS[activations]
    rng = np.random.default_rng(0)
    nodes, inits, outputs = [], [], []
    for index, n in enumerate(widths):
        packed = rng.integers(0, 255, (n, k // block, block // 2), dtype=np.uint8)
        inits += [numpy_helper.from_array(packed, f"B{index}"),
                  numpy_helper.from_array((rng.random(n * k // block) * 0.01).astype(dtype), f"S{index}")]
        nodes.append(helper.make_node("MatMulNBits", ["A", f"B{index}", f"S{index}"], [f"Y{index}"],
                                      domain="com.microsoft", K=k, N=n, bits=4, block_size=block, accuracy_level=4))
        outputs.append(helper.make_tensor_value_info(f"Y{index}", elem, ["M", n]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", elem, ["M", k])], outputs, inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def ort_us(widths: list[int], k: int, rows: int, threads: int, activations: str = "float32") -> float:
    """Microseconds per call: the best of 5 means over enough calls to take ~0.2 s."""
    session = _session(widths, k, threads, activations=activations)
    feeds = {"A": np.random.default_rng(1).standard_normal((rows, k)).astype(ACTIVATIONS[activations][1])}
    for _ in range(10):
        session.run(None, feeds)
    started = time.perf_counter()
    session.run(None, feeds)
    calls = max(5, int(0.2 / max(1e-6, time.perf_counter() - started)))
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            session.run(None, feeds)
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
    return best


def ggml_us(binary: Path, shapes: list[tuple[int, int, int]]) -> dict[tuple[int, int, int], float]:
    """(N, K, rows) -> microseconds per run of ggml's MUL_MAT, Q4_0 weights times float32 activations."""
    lines = []
    for n, k, rows in shapes:
        weights_nb1 = Q4_0_BLOCK_BYTES * k // 32
        activations_nb1 = 4 * k
        weights = (f"{GGML_TYPE_Q4_0} {k} {n} 1 1 {Q4_0_BLOCK_BYTES} {weights_nb1} {weights_nb1 * n} "
                   f"{weights_nb1 * n}")
        activations = (f"{GGML_TYPE_F32} {k} {rows} 1 1 4 {activations_nb1} {activations_nb1 * rows} "
                       f"{activations_nb1 * rows}")
        lines.append(f"{GGML_OP_MUL_MAT} {GGML_TYPE_F32} {n} {rows} 1 1 0 2 {weights} {activations} -")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as file:
        file.write("\n".join(lines) + "\n")
    try:
        done = subprocess.run([str(binary), "perf", "-b", "CPU", "--test-file", file.name], capture_output=True,
                              text=True, check=True)
    finally:
        os.unlink(file.name)
    timings = [float(m.group(1)) for m in re.finditer(r"([0-9.]+) us/run", done.stdout)]
    if len(timings) != len(shapes):
        raise SystemExit(f"test-backend-ops printed {len(timings)} timings for {len(shapes)} cases:\n"
                         f"{done.stdout[-2000:]}")
    return dict(zip(shapes, timings))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", default="1,2", help="activation rows to time, comma-separated (default 1,2)")
    parser.add_argument("--activations", choices=tuple(ACTIVATIONS), default="float32",
                        help="ORT's activation and scale type (float16: a float16 graph's MatMulNBits)")
    parser.add_argument("--test-backend-ops", type=Path, help="llama.cpp's test-backend-ops binary (ggml's side)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="ORT's threads (default: hardware threads / 2, as test-backend-ops perf runs ggml)")
    args = parser.parse_args(argv)
    q, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim
    projections = {"q": ([q], args.hidden), "k, v (each)": ([kv], args.hidden), "o": ([args.hidden], q),
                   "gate, up (each)": ([args.intermediate], args.hidden), "down": ([args.hidden], args.intermediate),
                   "lm_head": ([args.vocab], args.hidden),
                   "q+k+v fused": ([q + 2 * kv], args.hidden), "gate+up fused": ([2 * args.intermediate], args.hidden)}
    try:
        rows_list = tuple(int(rows) for rows in args.rows.split(","))
    except ValueError:
        parser.error(f"--rows {args.rows}: give whole numbers, comma-separated")
    if not rows_list or min(rows_list) < 1:
        parser.error(f"--rows {args.rows}: each count must be at least 1")
    shapes = [(sum(widths), k, rows) for widths, k in projections.values() for rows in rows_list]
    theirs = ggml_us(args.test_backend_ops, shapes) if args.test_backend_ops else {}
    table = []
    for name, (widths, k) in projections.items():
        first: tuple[float, float | None] | None = None  # this projection's times at the first row count
        for rows in rows_list:
            ours = ort_us(widths, k, rows, args.threads, args.activations)
            ggml = theirs.get((sum(widths), k, rows))
            first = first or (ours, ggml)
            megabytes = sum(widths) * k * Q4_0_BLOCK_BYTES / 32 / 1e6
            table.append([name, f"{sum(widths)} x {k}", str(rows), f"{ours:.0f}",
                          f"{ggml:.0f}" if ggml else "-", f"{ours / ggml:.2f}x" if ggml else "-",
                          f"{megabytes / ours * 1e3:.1f}", f"{ours / first[0]:.2f}x",
                          f"{ggml / first[1]:.2f}x" if ggml and first[1] else "-"])
    print(markdown_table(["projection", "N x K", "rows", "ORT MatMulNBits us", "ggml Q4_0 us", "ORT / ggml",
                          "ORT GB/s (Q4_0 bytes)", f"ORT / {rows_list[0]} row(s)", f"ggml / {rows_list[0]} row(s)"],
                         table))
    print(f"\n{args.threads} thread(s), {args.activations} activations. {provenance()}")


if __name__ == "__main__":
    main()
