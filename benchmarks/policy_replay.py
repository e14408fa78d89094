"""What the verify policy buys on a recording, under the cost curves of three kinds of hardware: the demo's
recorded steps (benchmarks/record_trace.py) replayed with runtime.policy.simulate, speed relative to greedy for
full blocks and for `--verify auto`; where the recording has both (a DSpark draft's), `auto` reading the
draft's confidence head, the argmax probability of its logits, and both (the policy reading, step by step, the
one whose calibrated predictions have scored better so far, as decoding does). Prints the table
docs/verify-policy.md shows.

    python benchmarks/policy_replay.py [--trace tests/data/demo_trace.json] [--cost-model NAME=FILE ...]
        [--json docs/figures/NAME.json]

`--cost-model NAME=FILE` adds a measured curve (JSON with verify_ms for T = 1..B and draft_ms, as `generate
--cost-model` reads), e.g. one lowering's recorded `costs` and a peer's measured step times. `--json FILE` writes
the table as a figures record (dflash_onnx/figures.py), the file docs/figures/ keeps as the page's source.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dflash_onnx.figures import figures_record, render
from dflash_onnx.runtime.costs import read_costs
from dflash_onnx.runtime.manifest import CostModel
from dflash_onnx.runtime.policy import simulate

TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "demo_trace.json"


def curves(block: int) -> dict[str, CostModel]:
    """t(T) for T = 1..block and the draft step, relative to one decode step."""
    return {"flat (AI 100-like)": CostModel([1.0] * block, 0.3),
            "CPU-like (T=16 at 3.25x, draft 1.6x)": CostModel([1 + 0.15 * t for t in range(block)], 1.6),
            "M2-like (T=16 at 7.5x, draft 1.0x)": CostModel([1 + 6.5 * t / (block - 1) for t in range(block)], 1.0)}


def recorded_steps(trace: dict, *keys: str) -> list[tuple[np.ndarray, int]]:
    """Per full-block step: the draft's confidence in each proposal (`keys`: one signal [P], or several stacked
    [signals, P]; the recorded confidence by default), and how many the target accepted."""
    keys = keys or ("confidence",)
    return [(np.asarray(step[keys[0]]) if len(keys) == 1 else np.stack([step[key] for key in keys]),
             step["accepted"]) for step in trace["steps"]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--cost-model", action="append", default=[], metavar="NAME=FILE",
                        help="a measured curve to replay beside the three kinds (repeatable)")
    parser.add_argument("--json", type=Path, help="also write the table as a figures record to this file")
    args = parser.parse_args(argv)
    trace = json.loads(args.trace.read_text())
    block = trace.get("verify_rows", trace["block_size"])
    measured = {}
    for given in args.cost_model:
        name, _, path = given.partition("=")
        if not path:
            parser.error(f"--cost-model {given}: give NAME=FILE")
        costs = read_costs(Path(path), block)
        first = costs.verify_ms[0]  # relative to one decode step, as the three kinds are
        measured[name] = CostModel([t / first for t in costs.verify_ms[:block]], costs.draft_ms / first)
    steps = recorded_steps(trace)
    both = trace.get("draft_kind") == "dspark" and "argmax_probability" in trace["steps"][0]
    rows = []
    for name, costs in {**curves(block), **measured}.items():
        auto, full = simulate("auto", costs, steps), simulate("full", costs, steps)
        row = [name, f"{full['full_rate'] / full['greedy_rate']:.2f}x", f"{auto['rate'] / auto['greedy_rate']:.2f}x"]
        if both:
            for keys in (["argmax_probability"], ["confidence", "argmax_probability"]):
                replayed = simulate("auto", costs, recorded_steps(trace, *keys))
                row.append(f"{replayed['rate'] / replayed['greedy_rate']:.2f}x")
        rows.append(row)
    tau = np.mean([1 + accepted for _, accepted in steps])
    header = ["cost curve", "full blocks", "auto (confidence head)" if both else "auto"]
    header += ["auto (argmax probability)", "auto (both, the better online)"] if both else []
    record = figures_record(header, rows, f"{len(steps)} recorded full-block steps, tau {tau:.2f}.", libraries=(),
                            verb="Computed")
    print(render(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
