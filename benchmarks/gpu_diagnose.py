"""One buffer-form target on the CPU and the CUDA provider, call by call: where CUDA parts from the CPU, if it does.

Runs one ORT lowering's buffer-form target (lowered with --provider cpu, so both providers can run the same
graph) on the CPU and on the CUDA provider: by default a 20-token prefill, a 16-token verify after it and a
1-token decode (--calls START:COUNT,...), and prints the relative difference of the context rows each call
returns and of layer 0's K/V rows. --binding off runs the graph with plain numpy feeds instead of the session's
in-place IOBinding (past and present then are different tensors, so ORT takes its copying path).

    python benchmarks/gpu_diagnose.py CPU_LOWERED_DIR [--calls 0:20,20:16,36:1] [--binding on|off]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets.ort.session import OrtBufferSession

CALLS = ((0, 20), (20, 16), (36, 1))  # (start, new tokens): prefill, verify, decode
ROWS = 256  # K/V rows of the plain run's buffers


def feeds_for(rng: np.random.Generator, vocab: int, start: int, count: int) -> dict[str, np.ndarray]:
    total = start + count
    return {"input_ids": rng.integers(0, vocab, size=(1, count)), "position_ids": np.arange(start, total)[None],
            "seqlens_k": np.array([total - 1], np.int32), "total_sequence_length": np.array(total, np.int32)}


def run(directory: Path, provider: str, calls, binding: bool) -> tuple[list[dict], dict]:
    manifest = load_manifest(directory)
    rng = np.random.default_rng(0)
    wanted = ["greedy_ids", "target_hidden"]
    if binding:
        session = OrtBufferSession(directory / manifest.target.file, manifest, providers=[provider])
        opened = session._session.get_providers()
    else:
        session = ort.InferenceSession(str(directory / manifest.target.file), providers=[provider])
        opened = session.get_providers()
        graph = manifest.target
        kv = {past: np.zeros((1, *graph.kv_shape(past)[:1], ROWS, graph.kv_shape(past)[1]), manifest.numpy_dtype)
              for past in graph.kv_inputs}
    if provider not in opened:  # ORT falls back to the CPU with only a warning
        sys.exit(f"{provider} did not open (providers: {opened})")
    outputs = []
    for start, count in calls:
        feeds = feeds_for(rng, manifest.vocab_size, start, count)
        if binding:
            outputs.append(session.run(feeds, wanted))
            continue
        names = wanted + list(graph.kv_outputs)
        values = dict(zip(names, session.run(names, {**feeds, **kv})))
        kv = {past: values[present] for past, present in zip(graph.kv_inputs, graph.kv_outputs)}
        outputs.append({name: values[name] for name in wanted})
    return outputs, (session.kv_buffers() if binding else kv)


def relative(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.nanmax(np.abs(a - b)) / np.nanmax(np.abs(a))) if np.isfinite(b).all() else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--calls", default=",".join(f"{s}:{c}" for s, c in CALLS))
    parser.add_argument("--binding", choices=("on", "off"), default="on")
    args = parser.parse_args()
    calls = [tuple(int(n) for n in call.split(":")) for call in args.calls.split(",")]
    binding = args.binding == "on"
    (cpu, cpu_kv), (cuda, cuda_kv) = (run(args.directory, provider, calls, binding)
                                      for provider in ("CPUExecutionProvider", "CUDAExecutionProvider"))
    for (start, count), a, b in zip(calls, cpu, cuda):
        difference = relative(a["target_hidden"], b["target_hidden"])
        print(f"call at {start} with {count} tokens: context rows differ by {difference:.3g} of scale, argmax ids "
              f"agree {(a['greedy_ids'] == b['greedy_ids']).mean():.2f}")
    end = calls[-1][0] + calls[-1][1]
    for name in list(cpu_kv)[:2]:
        rows = [relative(cpu_kv[name][:, :, r], cuda_kv[name][:, :, r]) for r in range(end)]
        bad = [r for r in range(end) if rows[r] > 0.05]
        print(f"{name}: worst row {int(np.nanargmax(rows))} ({np.nanmax(rows):.3g}), rows off by > 0.05: {bad}, "
              f"rows not finite on CUDA: {[r for r in range(end) if not np.isfinite(cuda_kv[name][:, :, r]).all()]}")


if __name__ == "__main__":
    main()
