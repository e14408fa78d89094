"""tau of the reference `dflash` package with the shipped demo pair, on the demo's held-out prompts.

    python benchmarks/reference_tau.py [--prompts 4] [--pair DIR]      (needs: pip install --no-deps dflash==0.1.0)

`dflash-onnx demo --json` reports our tau on the same prompts; the two should be equal.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from dflash import model as dflash_model
from transformers import AutoModelForCausalLM

from dflash_onnx.demo import PAIR_DIR, held_out_prompts
from dflash_onnx.runtime.tokenizer import TextCodec

dflash_model._cuda_time = time.perf_counter  # the reference times itself with CUDA events; plain clock on CPU


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--pair", type=Path, default=PAIR_DIR, help="a pair directory (target/, draft/)")
    args = parser.parse_args()
    codec = TextCodec(args.pair / "target", artifact=False)
    target = AutoModelForCausalLM.from_pretrained(str(args.pair / "target"), dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    draft = dflash_model.DFlashDraftModel.from_pretrained(str(args.pair / "draft"), dtype=torch.float32).eval()
    lengths: list[int] = []
    for text in held_out_prompts(args.prompts):
        ids = torch.tensor(codec.encode(text))[None]
        out = dflash_model.dflash_generate(draft, target, ids, 128, None, return_stats=True)
        lengths += list(out.acceptance_lengths)
    print(json.dumps({"reference_tau": float(np.mean(lengths)), "steps": len(lengths)}))


if __name__ == "__main__":
    main()
