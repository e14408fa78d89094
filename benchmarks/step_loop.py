"""The batch's own work per step, without a model: requests side by side as StepLoop tasks on a store whose calls
return at once, so what is timed is the barrier, the tasks' switches and the batched call's feeds, per step and
per request-step, at each width. What a step of real calls pays on top of its calls.

    python benchmarks/step_loop.py [--widths 1,2,4,8] [--steps 3000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dflash_onnx.runtime.batching import StepBatcher, StepLoop


class _InstantStore:
    """A SlotStore that returns greedy ids of zeros at once."""

    input_names, output_names = ["input_ids", "position_ids", "seqlens_k", "total_sequence_length"], ["greedy_ids"]

    def __init__(self, slots: int):
        self.slots, self.active = slots, 0

    def run_slots(self, first: int, feeds: dict, names: list[str]) -> dict:
        return {"greedy_ids": np.zeros(feeds["input_ids"].shape, np.int64)}

    def move_slot(self, source: int, dest: int) -> None:
        pass


def per_step_us(width: int, steps: int) -> float:
    """Microseconds per step of `width` requests making `steps` 2-row calls each."""
    batcher = StepBatcher(_InstantStore(width), big_rows=2)

    def request() -> None:
        slot = batcher.open()
        for step in range(steps):
            slot.run({"input_ids": np.zeros((1, 2), np.int64), "position_ids": np.zeros((1, 2), np.int64),
                      "seqlens_k": np.array([step + 2], np.int32)}, ["greedy_ids"])
        slot.release()

    started = time.perf_counter()
    StepLoop(batcher).run([request] * width, width)
    return 1e6 * (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    for width in (int(w) for w in args.widths.split(",")):
        us = per_step_us(width, args.steps)
        print(f"{width} requests: {us:.0f} us a step, {us / width:.0f} us a request-step")


if __name__ == "__main__":
    main()
