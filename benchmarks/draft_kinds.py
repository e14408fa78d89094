"""DFlash, DFlash2 and DSpark drafts distilled for the shipped demo target with the same budget, the same
prompts and the same held-out continuations, side by side: held-out tau (tokens per step: 1 + the leading
proposals of each kind's own greedy chain that equal the target's continuation).

The options are the demo draft's (benchmarks/build_pair.py: block 16, layers 1 and 3 tapped, 512 prompts of 64
bytes from the training half of the standard library, 160 new tokens, 24 held out), each kind with its
recommended head sizes (speculators' defaults: DFlash2's selector rank 256 over its top 16, DSpark's vanilla
Markov head of rank 256 and its confidence head; DSpark proposes from its anchor's slot too). Prints the table
in the docs' format; drafts and logs go to --work.

    python benchmarks/draft_kinds.py [--minutes 10] [--work /tmp/draft_kinds]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_pair import SPECIALS, stdlib_files  # noqa: E402

from dflash_onnx.figures import markdown_table, provenance  # noqa: E402
from dflash_onnx.training.distill import DistillOptions, distill  # noqa: E402

KINDS = ("dflash", "dflash2", "dspark")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10, help="training budget of each draft")
    parser.add_argument("--work", type=Path, default=Path("/tmp/draft_kinds"))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--confidence-target", choices=["sampled", "greedy"], default="sampled",
                        help="what DSpark's confidence head learns (dflash_onnx/training/objectives.py)")
    args = parser.parse_args(argv)
    target = Path(__file__).resolve().parents[1] / "dflash_onnx" / "demo_pair" / "target"
    train, _ = stdlib_files()
    os.environ.setdefault("DFLASH_ONNX_CACHE", str(args.work / "cache"))  # one set of continuations for all
    rows = []
    for kind in args.kinds.split(","):
        out = args.work / kind
        if out.exists():
            shutil.rmtree(out)
        options = DistillOptions(block_size=16, draft_layers=1, target_layer_ids=[1, 3], time_budget_min=args.minutes,
                                 seed=0, lr=1e-3, num_prompts=512, prompt_tokens=64, new_tokens=160, held_out=24,
                                 eval_every=50, mask_token_id=256 + SPECIALS.index("<mask>"), draft_type=kind,
                                 confidence_target=args.confidence_target)
        report = distill(target, out, options, data_paths=train)
        rows.append([kind, report["steps"], f"{report['seconds'] / 60:.1f}", f"{report['tau_before']:.2f}",
                     f"{report['tau_after']:.2f}"])
        print(json.dumps({"kind": kind, **{k: report[k] for k in ("steps", "seconds", "tau_before", "tau_after")}}),
              file=sys.stderr)
    print(markdown_table(["draft (demo target, block 16)", "steps", "minutes", "held-out tau before",
                          "held-out tau after"], rows))
    print()
    print(provenance())


if __name__ == "__main__":
    main()
