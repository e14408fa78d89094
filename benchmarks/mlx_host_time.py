"""The MLX lowering against mlx-lm's native model of the same target (issue 18), side by side in one process.

Builds a random Qwen3 pair with the Qwen3-4B layer count (36 layers) at a narrow width, exports it (float32),
lowers it for MLX in the fused buffer form (default) and op by op (`--kv-buffer off`), loads the same target
checkpoint with mlx-lm, and reports per target call at 1 and 16 tokens:

- host: the time to build the call's computation (MLX is lazy: the Python work before `mx.eval`),
- step: the whole call, evaluated, at a context of `--contexts` tokens (each step rolled back, so the context
  stays put), and each backend's step relative to mlx-lm's. The context is prefilled token by token, or with
  `--synthetic-context` its K/V rows are written directly (random values, the same for every backend: a step's
  time does not depend on them, and prefilling 4000 tokens of this 36-layer model takes ~10 min per backend on
  mlx[cpu]).

Needs mlx (mlx[cpu] on Linux) and mlx-lm (`pip install mlx-lm`); torch + transformers to build and export.

    python benchmarks/mlx_host_time.py --work /tmp/mlxbench [--contexts 256,4000] [--repeats 20] [--load 1] [--cold]
        [--fused-only] [--synthetic-context] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash_onnx.exporter.export import export_pair
from dflash_onnx.exporter.tiny import TinySpec, build_pair
from dflash_onnx.figures import markdown_table, provenance
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets.backend import LowerRequest
from dflash_onnx.targets.mlx.lower import lower_mlx
from dflash_onnx.targets.mlx.options import MlxOptions
from dflash_onnx.targets.mlx.session import MlxSession

SPEC = TinySpec(vocab_size=8192, hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=128, intermediate_size=1536,
                target_layers=36, draft_layers=2, target_layer_ids=[1, 9, 17, 25, 33], block_size=16,
                max_positions=8192, seed=18)


class _TimedEval:
    """Stands in for mlx.core in a session: notes when the session, done building its call, evaluates it."""

    def __init__(self):
        self.called: float | None = None  # the first evaluation of the current call

    def __getattr__(self, name):
        return getattr(mx, name)

    def eval(self, *arrays):
        self.called = self.called or time.perf_counter()
        mx.eval(*arrays)


def _ours(session: MlxSession, graph):
    """(call, fill) on our session: a call of `ids` at position `start` -> (host seconds, total seconds), and
    `fill(rows)`, which sets the K/V context to `rows` given rows. The buffer form keeps its K/V; the concat
    form's come back and are fed again (their prefix: a rollback to `start`)."""
    timed = _TimedEval()
    session._mx = timed
    buffer = session.retains_state
    kv_inputs, kv_outputs = graph.kv_inputs, graph.kv_outputs
    kv = {n: np.zeros((1, 0, graph.num_kv_heads, graph.head_dim), np.float32) for n in kv_inputs}

    def call(ids: list[int], start: int) -> tuple[float, float]:
        total = start + len(ids)
        feeds = {"input_ids": np.array([ids]), "position_ids": np.arange(start, total)[None]}
        if buffer:
            feeds.update(seqlens_k=np.array([total - 1], np.int32), total_sequence_length=np.array(total, np.int32))
        else:
            feeds.update({n: kv[n][:, :start] for n in kv_inputs})
        names = ["greedy_ids", "target_hidden"] + ([] if buffer else kv_outputs)
        timed.called = None
        began = time.perf_counter()
        out = session.run(feeds, names)
        done = time.perf_counter()
        if not buffer:
            kv.update({n: out[o] for n, o in zip(kv_inputs, kv_outputs)})
        return timed.called - began, done - began

    def fill(rows: list[mx.array]) -> None:
        if buffer:
            held = session.state.feeds({"total_sequence_length": rows[0].shape[2]})
            for name, given in zip(kv_inputs, rows):
                held[name][:, :, :given.shape[2]] = given.astype(held[name].dtype)
            mx.eval(*held.values())
        else:
            kv.update({n: np.array(r.transpose(0, 2, 1, 3)) for n, r in zip(kv_inputs, rows)})

    return call, fill


def _native_fill(cache):
    """`fill(rows)` for mlx-lm's cache: K/V inputs alternate key, value per layer, as mlx-lm's cache pairs them."""
    def fill(rows: list[mx.array]) -> None:
        for c, keys, values in zip(cache, rows[0::2], rows[1::2]):
            c.trim(c.offset)
            c.update_and_fetch(keys, values)
        mx.eval([c.state for c in cache])

    return fill


def _native(model, cache):
    def call(ids: list[int], start: int) -> tuple[float, float]:
        for c in cache:
            c.trim(c.offset - start)
        began = time.perf_counter()
        logits = model(mx.array([ids]), cache=cache)
        greedy = mx.argmax(logits, axis=-1)
        built = time.perf_counter()
        mx.eval(greedy, [c.state for c in cache])
        np.array(greedy)  # to the host, as our sessions return greedy ids
        return built - began, time.perf_counter() - began

    return call


COLD_BYTES = 64 * 2**20  # more than the CPU's caches: touched before a call, none of its host data is cached


def _measure(calls: dict, context: int, rows: int, repeats: int, cold: np.ndarray | None = None
             ) -> dict[str, tuple[float, float]]:
    """Median (host, step) seconds of `rows`-token calls at `context` (each rolled back to it) per backend, the
    backends taking turns call by call so that a drift in the machine's speed reaches them alike. `cold`: an
    array written before each call, so every backend's call starts with the caches the previous call left
    (which differ with what ran before: a 16-row step streams ~1 GB through them) replaced alike."""
    ids = list(range(3, 3 + rows))
    samples: dict[str, list] = {name: [] for name in calls}
    for call in calls.values():
        call(ids, context)  # warm (shapes, kernels)
    for _ in range(repeats):
        for name, call in calls.items():
            if cold is not None:
                cold += 1.0
            samples[name].append(call(ids, context))
    return {name: (statistics.median(s[0] for s in found), statistics.median(s[1] for s in found))
            for name, found in samples.items()}


def _prefill(call, context: int) -> None:
    for start in range(0, context, 256):
        call(list(range(3, 3 + min(256, context - start))), start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--contexts", default="256,4000")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="measure beside N busy processes (python -c 'while True: pass'), ended by pid")
    parser.add_argument("--fused-only", action="store_true",
                        help="leave out the op-by-op lowering (its 4000-token calls take minutes on mlx[cpu])")
    parser.add_argument("--synthetic-context", action="store_true",
                        help="write each context's K/V rows directly (random) instead of prefilling it token by token")
    parser.add_argument("--cold", action="store_true",
                        help="write 64 MB before each call: every call starts with cold caches, whatever ran before")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    work = args.work
    target_dir, draft_dir = work / "pair" / "target", work / "pair" / "draft"
    if not (target_dir / "config.json").exists():
        build_pair(SPEC, work / "pair")
    if not (work / "onnx" / "dflash.json").exists():
        export_pair(target_dir, draft_dir, work / "onnx", progress=False)
    ctx_len = max(contexts) + 64
    lowered = {}
    for name, kv_buffer in (("fused", True),) if args.fused_only else (("fused", True), ("op by op", False)):
        out = work / f"mlx-{'fused' if kv_buffer else 'concat'}-{ctx_len}"
        if not (out / "dflash.json").exists():
            lower_mlx(work / "onnx", out, MlxOptions(kv_buffer=kv_buffer, ctx_len=ctx_len),
                      LowerRequest(progress=False))
        lowered[name] = out

    from mlx_lm.models.cache import make_prompt_cache

    from dflash_onnx.peers import mlx_lm_model

    model = mlx_lm_model(target_dir)
    cache = make_prompt_cache(model)
    runs = {}
    for name, directory in lowered.items():
        manifest = load_manifest(directory)
        session = MlxSession(directory, manifest, "target")
        runs[name] = (session, *_ours(session, manifest.target))
    rows_table = []
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        _table(contexts, args.repeats, model, cache, runs, manifest.target, rows_table,
               np.zeros(COLD_BYTES // 8) if args.cold else None, args.synthetic_context)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    print(_markdown(rows_table, list(runs)))
    print(f"\n{provenance(libraries=('mlx', 'mlx-lm'))}")
    if args.json:
        args.json.write_text(json.dumps({"spec": SPEC.__dict__, "mlx": mx.__version__, "load": args.load,
                                         "cold": args.cold, "rows": rows_table}, indent=1, default=str))


def _markdown(rows_table: list[dict], ours: list[str]) -> str:
    """The measured cells as docs/mlx.md prints them: host and step per backend, ours relative to mlx-lm's step."""
    def cell(row: dict, name: str) -> str:
        host, step = row[name][0] * 1e3, row[name][1] * 1e3
        relative = "" if name == "mlx-lm" else f" ({row[name][1] / row['mlx-lm'][1]:.2f}x)"
        return f"{host:.2f} / {step:.1f} ms{relative}"

    header = ["context, rows", "mlx-lm host / step", *(f"{name} host / step (vs mlx-lm)" for name in ours)]
    return markdown_table(header, [[f"{row['context']}, {row['rows']}", *(cell(row, n) for n in ["mlx-lm", *ours])]
                                   for row in rows_table])


def _table(contexts: list[int], repeats: int, model, cache, runs: dict, graph, rows_table: list,
           cold: np.ndarray | None, synthetic: bool) -> None:
    calls = {"mlx-lm": _native(model, cache), **{name: call for name, (_, call, _) in runs.items()}}
    fills = {"mlx-lm": _native_fill(cache), **{name: fill for name, (_, _, fill) in runs.items()}}
    heads, head_dim, layers = graph.num_kv_heads, graph.head_dim, len(graph.kv_inputs)
    for context in contexts:
        found = {rows: {"context": context, "rows": rows, "synthetic": synthetic,
                        "nodes": {n: len(s.nodes) for n, (s, _, _) in runs.items()}} for rows in (1, 16)}
        if synthetic:
            given = [mx.random.normal((1, heads, context, head_dim), key=mx.random.key(i)) for i in range(layers)]
            for fill in fills.values():
                fill(given)
        else:
            for call in calls.values():
                _prefill(call, context)  # once per backend and context: every measured call is rolled back to it
        for rows in (1, 16):
            found[rows].update(_measure(calls, context, rows, repeats, cold))
        for rows, row in found.items():
            rows_table.append(row)
            native_step = row["mlx-lm"][1]
            print(f"context {context:5d}, {rows:2d} rows: " + "; ".join(
                f"{k} host {row[k][0] * 1e3:.2f} ms, step {row[k][1] * 1e3:.2f} ms ({row[k][1] / native_step:.2f}x)"
                for k in calls), flush=True)


if __name__ == "__main__":
    main()
