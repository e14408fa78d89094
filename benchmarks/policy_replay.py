"""What the verify policy buys on a recording, under the cost curves of three kinds of hardware: the demo's
recorded steps (benchmarks/record_trace.py) replayed with runtime.policy.simulate, speed relative to greedy for
full blocks and for `--verify auto`; where the recording has both (a DSpark draft's), `auto` once reading the
draft's confidence head and once the argmax probability of its logits. Prints the table docs/verify-policy.md
shows.

    python benchmarks/policy_replay.py [--trace tests/data/demo_trace.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dflash_onnx.figures import markdown_table, provenance
from runtime.manifest import CostModel
from runtime.policy import simulate

TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "demo_trace.json"


def curves(block: int) -> dict[str, CostModel]:
    """t(T) for T = 1..block and the draft step, relative to one decode step."""
    return {"flat (AI 100-like)": CostModel([1.0] * block, 0.3),
            "CPU-like (T=16 at 3.25x, draft 1.6x)": CostModel([1 + 0.15 * t for t in range(block)], 1.6),
            "M2-like (T=16 at 7.5x, draft 1.0x)": CostModel([1 + 6.5 * t / (block - 1) for t in range(block)], 1.0)}


def recorded_steps(trace: dict, key: str = "confidence") -> list[tuple[np.ndarray, int]]:
    """Per full-block step: the draft's confidence in each proposal (`key`), and how many the target accepted."""
    return [(np.asarray(step[key]), step["accepted"]) for step in trace["steps"]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE)
    args = parser.parse_args(argv)
    trace = json.loads(args.trace.read_text())
    steps = recorded_steps(trace)
    both = trace.get("draft_kind") == "dspark" and "argmax_probability" in trace["steps"][0]
    rows = []
    for name, costs in curves(trace.get("verify_rows", trace["block_size"])).items():
        auto, full = simulate("auto", costs, steps), simulate("full", costs, steps)
        row = [name, f"{full['full_rate'] / full['greedy_rate']:.2f}x", f"{auto['rate'] / auto['greedy_rate']:.2f}x"]
        if both:
            argmax = simulate("auto", costs, recorded_steps(trace, "argmax_probability"))
            row.append(f"{argmax['rate'] / argmax['greedy_rate']:.2f}x")
        rows.append(row)
    tau = np.mean([1 + accepted for _, accepted in steps])
    header = ["cost curve", "full blocks", "auto (confidence head)" if both else "auto"]
    print(markdown_table(header + (["auto (argmax probability)"] if both else []), rows))
    print(f"\n{len(steps)} recorded full-block steps, tau {tau:.2f}. {provenance(libraries=(), verb='Computed')}")


if __name__ == "__main__":
    main()
