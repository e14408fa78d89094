"""Where ONNX Runtime's CUDA GroupQueryAttention parts from its CPU one over the buffer form's in-place K/V.

Runs one ORT lowering's buffer-form target (lowered with --provider cpu, so both providers can run the same
graph) on the CPU and on the CUDA provider: a 20-token prefill, a 16-token verify after it and a 1-token
decode, and prints the relative difference of the context rows each call returns and of layer 0's K/V rows.

    python benchmarks/gpu_diagnose.py CPU_LOWERED_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from runtime.manifest import load_manifest
from targets.ort.session import OrtBufferSession

CALLS = ((0, 20), (20, 16), (36, 1))  # (start, new tokens): prefill, verify, decode


def run(directory: Path, provider: str) -> tuple[list[dict], dict]:
    manifest = load_manifest(directory)
    session = OrtBufferSession(directory / manifest.target.file, manifest, providers=[provider])
    rng = np.random.default_rng(0)
    outputs = []
    for start, count in CALLS:
        total = start + count
        feeds = {"input_ids": rng.integers(0, manifest.vocab_size, size=(1, count)),
                 "position_ids": np.arange(start, total)[None], "seqlens_k": np.array([total - 1], np.int32),
                 "total_sequence_length": np.array(total, np.int32)}
        outputs.append(session.run(feeds, ["greedy_ids", "target_hidden"]))
    return outputs, session.kv_buffers()


def relative(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.nanmax(np.abs(a - b)) / np.nanmax(np.abs(a))) if np.isfinite(b).all() else float("nan")


def main() -> None:
    directory = Path(sys.argv[1])
    (cpu, cpu_kv), (cuda, cuda_kv) = run(directory, "CPUExecutionProvider"), run(directory, "CUDAExecutionProvider")
    for (start, count), a, b in zip(CALLS, cpu, cuda):
        difference = relative(a["target_hidden"], b["target_hidden"])
        print(f"call at {start} with {count} tokens: context rows differ by {difference:.3g} of scale, argmax ids "
              f"agree {(a['greedy_ids'] == b['greedy_ids']).mean():.2f}")
    end = CALLS[-1][0] + CALLS[-1][1]
    for name in list(cpu_kv)[:2]:
        rows = [relative(cpu_kv[name][:, :, r], cuda_kv[name][:, :, r]) for r in range(end)]
        print(f"{name}: worst row {int(np.nanargmax(rows))} ({np.nanmax(rows):.3g}), rows not finite on CUDA: "
              f"{[r for r in range(end) if not np.isfinite(cuda_kv[name][:, :, r]).all()]}")


if __name__ == "__main__":
    main()
