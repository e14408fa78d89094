"""The float16 error curve of a target graph over position: the K it writes and its logits, run on ONNX
Runtime as `-convert-to-fp16` would compute it (targets/ai100/emulate.py) against float32.

    python benchmarks/ai100_fp16_curve.py AI100_DIR --ctx-len 4096            # retained form, the lowering's plan
    python benchmarks/ai100_fp16_curve.py EXPORT_DIR --positions 0,1000,3000  # the export: in-graph rotary angles
    ... --no-plan                                                        # every node in float16

Works on any graph whose inputs are named as dflash-onnx names them (an export, or an AI 100 lowering of
this or an earlier version); the numbers are max |error| / max |float32 value| over the rows written.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx

from dflash_onnx.targets.ai100.emulate import GraphSession, emulated_graph
from dflash_onnx.targets.ai100.precision import norm_outputs


def feeds_for(model: onnx.ModelProto, position: int, rows: int, ctx_len: int, rng) -> dict[str, np.ndarray]:
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.input:
        dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.name == "input_ids":
            feeds[value.name] = rng.integers(3, 64, (1, rows)).astype(np.int64)
        elif value.name == "position_ids":
            feeds[value.name] = np.arange(position, position + rows, dtype=np.int64)[None]
        elif value.name == "comp_ctx_lengths":
            feeds[value.name] = np.zeros(ctx_len, np.int64)
        elif len(dims) == 4 and dims[2] == "ctx_len":  # a retained buffer [batch, heads, ctx_len, head_dim]
            buffer = rng.standard_normal((1, dims[1], ctx_len, dims[3]))
            feeds[value.name] = buffer.astype(np.float16).astype(np.float32)
        else:  # the export's past K/V: [batch, past, heads, head_dim], empty
            feeds[value.name] = np.zeros((1, 0, dims[2], dims[3]), np.float32)
    return feeds


def written(array: np.ndarray, position: int, rows: int, retained: bool) -> np.ndarray:
    """The rows a call wrote: slots position.. of a retained buffer, or the whole present of an export."""
    return array[:, :, position : position + rows] if retained else array


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path)
    parser.add_argument("--graph", default="target.onnx")
    parser.add_argument("--ctx-len", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--positions", default="0,256,1024,2048,3000,4000")
    parser.add_argument("--no-plan", action="store_true", help="keep nothing in float32")
    args = parser.parse_args()
    model = onnx.load(str(args.dir / args.graph), load_external_data=False)
    plan = set() if args.no_plan else set(norm_outputs(model))
    exact = GraphSession(emulated_graph(model, set(), round_to_fp16=False), args.dir, "curve.fp32")
    device = GraphSession(emulated_graph(model, plan), args.dir, "curve.fp16")
    keys = [o.name for o in model.graph.output if "key" in o.name]
    retained = any(o.name.endswith("_RetainedState") for o in model.graph.output)
    logits = exact.logits_name
    curve = []
    for position in (int(p) for p in args.positions.split(",")):
        if position + args.rows > args.ctx_len:
            continue
        feeds = feeds_for(model, position, args.rows, args.ctx_len, np.random.default_rng(position))
        want, got = exact.run(feeds, [logits, *keys]), device.run(feeds, [logits, *keys])
        rows = {n: (written(got[n], position, args.rows, retained), written(want[n], position, args.rows, retained))
                for n in keys}
        k = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in rows.values())
        err = float(np.abs(got[logits] - want[logits]).max() / np.abs(want[logits]).max())
        agree = float(np.mean(got[logits].argmax(-1) == want[logits].argmax(-1)))
        curve.append({"position": position, "k": k, "logits": err, "argmax_agree": agree})
        print(f"position {position:5d}  K error {k:.2e}  logits error {err:.2e}  argmax agree {agree:.2f}", flush=True)
    print(json.dumps({"dir": str(args.dir), "plan_nodes": len(plan), "curve": curve}))


if __name__ == "__main__":
    main()
