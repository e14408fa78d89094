"""Where a one-token decode step of an ORT lowering spends its time: ONNX Runtime's profiler over `--steps`
steps at `--context` tokens of (zero) K/V, each node's kernel time summed per op type, the median step reported.
The K/V buffers are bound as the runtime binds them (each layer's past and present one buffer, written in place).
Unpadded by default; `--rows N` profiles an N-token call (a verify); `--padded` runs the step as the runners send it
to a lowering with row multiple 2 (the token twice, its position repeated). For buffer-form target graphs (K/V
buffers, seqlens_k, total_sequence_length); several directories print side by side.

    python benchmarks/step_profile.py DIR [DIR ...] [--context 256] [--steps 12] [--threads 2] [--padded | --rows N]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from dflash_onnx.figures import markdown_table, provenance


def step_feeds(session: ort.InferenceSession, context: int, rows: int) -> dict[str, np.ndarray]:
    names = {i.name for i in session.get_inputs()}
    if not {"seqlens_k", "total_sequence_length"} <= names:
        raise SystemExit("step_profile reads buffer-form targets (lower --target ort, the default --kv-buffer on)")
    feeds = {"seqlens_k": np.array([context + rows - 1], np.int32),
             "total_sequence_length": np.array(context + rows, np.int32),
             "input_ids": np.full((1, rows), 5, np.int64), "position_ids": np.full((1, rows), context, np.int64)}
    for value in session.get_inputs():
        if value.name.startswith("past_key_values."):
            feeds[value.name] = np.zeros((1, value.shape[1], 2 * context, value.shape[3]), np.float32)
        elif value.name not in feeds:
            raise SystemExit(f"step_profile does not feed {value.name} (a recurrent target's state)")
    return feeds


def bind_in_place(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> ort.IOBinding:
    """The feeds bound as the runtime binds them: each K/V buffer is its layer's past input and present output
    (written in place, nothing copied), the other outputs allocated by ORT."""
    binding = session.io_binding()
    for name, value in feeds.items():
        if name.startswith("past_key_values."):
            buffer = ort.OrtValue.ortvalue_from_numpy(value)
            binding.bind_ortvalue_input(name, buffer)
            binding.bind_ortvalue_output(name.replace("past_key_values.", "present."), buffer)
        else:
            binding.bind_cpu_input(name, value)
    for output in session.get_outputs():
        if not output.name.startswith("present."):
            binding.bind_output(output.name, "cpu")
    return binding


def profile(directory: Path, context: int, steps: int, threads: int, rows: int = 1) -> dict[str, float]:
    """Median ms per step of each op type's kernels (and 'step': the median run)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level, options.enable_profiling = threads, 3, True
    with tempfile.TemporaryDirectory() as scratch:
        options.profile_file_prefix = str(Path(scratch) / "step")
        session = ort.InferenceSession(str(directory / "target.onnx"), options, providers=["CPUExecutionProvider"])
        binding = bind_in_place(session, step_feeds(session, context, rows))
        for _ in range(steps + 2):  # the first two warm up (prepacking, allocations) and are left out
            session.run_with_iobinding(binding)
        events = json.loads(Path(session.end_profiling()).read_text())
    runs = sorted((e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"),
                  key=lambda e: e["ts"])[2:]
    per_run = [collections.Counter() for _ in runs]
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            for run, totals in zip(runs, per_run):
                if run["ts"] <= event["ts"] <= run["ts"] + run["dur"]:
                    totals[event["args"]["op_name"]] += event["dur"] / 1000
    ops = {op for totals in per_run for op in totals}
    result = {op: statistics.median(totals[op] for totals in per_run) for op in ops}
    result["step"] = statistics.median(run["dur"] / 1000 for run in runs)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directories", type=Path, nargs="+")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=8, help="op types shown (by the first directory's time)")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--padded", action="store_true", help="the step padded to 2 rows as the runners pad it")
    shape.add_argument("--rows", type=int, default=1, help="tokens per call (16: a block's verify)")
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error("--rows must be at least 1")
    rows = 2 if args.padded else args.rows
    results = [profile(d, args.context, args.steps, args.threads, rows) for d in args.directories]
    ops = sorted({op for r in results for op in r} - {"step"}, key=lambda op: -results[0].get(op, 0))[: args.top]
    table = [[op, *(f"{r.get(op, 0):.2f}" for r in results)] for op in ops]
    table.append(["whole step (profiled)", *(f"{r['step']:.2f}" for r in results)])
    title = (f"ms per one-token step{', padded to 2 rows' if args.padded else ''}" if args.rows == 1
             else f"ms per {rows}-token step") + f", context {args.context}"
    print(markdown_table([title, *(str(d) for d in args.directories)], table))
    print()
    print(provenance())


if __name__ == "__main__":
    main()
