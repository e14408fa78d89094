"""A DSpark draft's two confidences in a real run: `--verify auto` reading only its confidence head's prediction,
only the argmax probability of its logits, or both (the policy reading, step by step, the one whose calibrated
predictions have scored better so far: what decoding does), beside greedy decoding and full blocks. One decoder,
the same held-out prompts, rounds interleaved; each policy keeps its own calibrations and step measurements across
prompts and rounds, as a decoder does across requests, and a first untimed round warms the sessions and both.
Prints tok/s (median over rounds), the ratio to greedy, and tokens per target call.

    python benchmarks/confidence_signals.py LOWERED_DIR [--prompts 8] [--tokens 128] [--rounds 3] [--load 0]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from dflash_onnx.demo import held_out_prompts
from dflash_onnx.figures import markdown_table, provenance
from dflash_onnx.runtime.decode import Decoder
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.runners import Proposal
from dflash_onnx.runtime.tokenizer import TextCodec
from dflash_onnx.targets import open_decoder

# name -> (decoding mode, --verify, which of the draft's confidences the policy is handed)
RUNS = {"greedy": ("greedy", "auto", None), "DFlash, full blocks": ("dflash", "full", None),
        "DFlash auto, confidence head": ("dflash", "auto", "confidence"),
        "DFlash auto, argmax probability": ("dflash", "auto", "argmax_probability"),
        "DFlash auto, both (the better online)": ("dflash", "auto", None)}


@contextmanager
def handing(signal: str | None):
    """Proposals hand the policy only `signal` (None: what they hand it in decoding, both)."""
    original = Proposal.signals
    if signal is not None:
        Proposal.signals = lambda proposal: getattr(proposal, signal)
    try:
        yield
    finally:
        Proposal.signals = original


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the decoder")
    args = parser.parse_args(argv)
    decoder = open_decoder(args.directory)
    if "draft_argmax_probability" not in decoder.manifest.draft.output_names():
        raise SystemExit(f"{args.directory}: its draft returns one confidence (a DSpark draft with a confidence "
                         "head, exported by this version, returns two)")
    if decoder.costs is None:
        raise SystemExit(f"{args.directory}: no cost curve, so --verify auto verifies full blocks: lower it first")
    codec = TextCodec(args.directory)
    prompts = [codec.encode(text) for text in held_out_prompts(args.prompts)]
    # each run's decoder on the same sessions learns its own calibrations and step measurements
    decoders = {name: Decoder(decoder.manifest, decoder.target, decoder.draft, costs=decoder.costs) for name in RUNS}
    rates: dict[str, list[float]] = {name: [] for name in RUNS}
    per_call: dict[str, list[float]] = {name: [] for name in RUNS}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        for round_index in range(args.rounds + 1):
            for name, (mode, verify, signal) in RUNS.items():
                tokens = calls = 0
                started = time.perf_counter()
                with handing(signal):
                    for prompt in prompts:
                        result = decoders[name].generate(prompt, args.tokens, mode, stop_token_ids=[],
                                                         verify=verify)
                        tokens, calls = tokens + len(result.tokens), calls + len(result.acceptance_lengths)
                if round_index:  # the first round warms sessions and calibrations
                    rates[name].append(tokens / (time.perf_counter() - started))
                    per_call[name].append(tokens / calls)
    except DFlashError as exc:
        raise SystemExit(str(exc)) from None
    finally:
        for process in busy:
            process.kill()
    greedy = statistics.median(rates["greedy"])
    rows = [[name, f"{statistics.median(rates[name]):.1f}", f"{statistics.median(rates[name]) / greedy:.2f}x",
             f"{statistics.median(per_call[name]):.2f}"] for name in RUNS]
    print(markdown_table(["decoding", "tok/s", "/ greedy", "tokens per target call"], rows))
    print(f"\n{args.prompts} held-out prompts x {args.tokens} tokens, medians of {args.rounds} interleaved rounds"
          f"{f', {args.load} busy process(es) beside' if args.load else ', quiet'}. "
          f"{provenance(verb='Measured')}")


if __name__ == "__main__":
    main()
