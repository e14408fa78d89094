"""Record what the verify policy's simulation replays: per full-block DFlash step of the demo pair (or another
export of its target) on held-out prompts, the draft's confidence in each proposal (its `draft_confidence`
output: the argmax probability for DFlash, the confidence head's prediction for DSpark), the argmax probability
of its logits beside it, and how many proposals the target accepted.

    python benchmarks/record_trace.py EXPORT_OR_LOWERED_DIR --out tests/data/demo_trace.json \
        [--prompts 8] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dflash_onnx.demo import held_out_prompts
from dflash_onnx.runtime.tokenizer import TextCodec
from dflash_onnx.targets import open_decoder


class Recording:
    """The draft session, keeping each call's confidences and its logits' argmax probabilities."""

    def __init__(self, session):
        self.session, self.calls = session, []
        self.input_names, self.output_names = session.input_names, session.output_names
        self.retains_state = session.retains_state

    def run(self, feeds, output_names=None):
        names = None if output_names is None else list(dict.fromkeys([*output_names, "logits"]))
        out = self.session.run(feeds, names)
        logits = out["logits"][0].astype(np.float64)
        probabilities = np.exp(logits - logits.max(-1, keepdims=True))
        argmax = probabilities.max(-1) / probabilities.sum(-1)
        self.calls.append((out["draft_confidence"][0].round(4).tolist(), argmax.round(4).tolist()))
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    decoder = open_decoder(args.dir)
    codec = TextCodec(args.dir)
    steps = []
    for text in held_out_prompts(args.prompts):
        recording = Recording(decoder.draft)
        result = decoder.sharing(draft=recording).generate(codec.encode(text), args.tokens, "dflash",
                                                           stop_token_ids=[], verify="full")
        proposals = decoder.manifest.verify_rows - 1
        full = [(c, n - 1) for c, n, v in zip(recording.calls, result.acceptance_lengths, result.verified)
                if v == proposals]  # the last, shortened step is left out
        steps += full
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "directory": str(args.dir), "block_size": decoder.manifest.block_size,
        "verify_rows": decoder.manifest.verify_rows, "draft_kind": decoder.manifest.draft_kind,
        "steps": [{"confidence": c, "argmax_probability": p, "accepted": a} for (c, p), a in steps]}) + "\n")
    print(f"wrote {args.out}: {len(steps)} steps, tau {1 + sum(a for _, a in steps) / len(steps):.2f}")


if __name__ == "__main__":
    main()
