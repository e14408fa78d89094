"""`dflash-onnx demo`: the embedded default job, offline.

Until a trained demo pair ships, it builds a tiny random pair whose draft is biased to agree with
its target, exports it once (cached), and runs greedy and DFlash on a few prompts side by side.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from .decode import Decoder
from .manifest import MANIFEST_NAME
from .tokenizer import TextCodec, has_tokenizer

DEMO_VERSION = "tiny-agree-v1"


def cache_dir() -> Path:
    root = os.environ.get("DFLASH_ONNX_CACHE") or Path.home() / ".cache" / "dflash-onnx"
    return Path(root) / DEMO_VERSION


def ensure_demo_export(progress: bool = True) -> Path:
    """Build and export the demo pair unless the cache already has it; return the export directory."""
    root = cache_dir()
    out = root / "onnx"
    if (out / MANIFEST_NAME).is_file():
        return out
    from .export import export_pair
    from .tiny import TinySpec, build_pair

    spec = TinySpec(agree=True, tie_embeddings=False, block_size=8, target_layers=4, draft_layers=1)
    target_dir, draft_dir = build_pair(spec, root / "pair")
    export_pair(target_dir, draft_dir, out, overwrite=True, progress=progress)
    return out


def run_demo(as_json: bool = False, max_new_tokens: int = 48, num_prompts: int = 4) -> int:
    out = ensure_demo_export(progress=True)
    decoder = Decoder.open(out)
    codec = TextCodec(out) if has_tokenizer(out) else None
    rng = np.random.default_rng(0)
    rows = []
    for index in range(num_prompts):
        prompt = rng.integers(2, decoder.manifest.vocab_size - 1, size=6)
        greedy = decoder.generate(prompt, max_new_tokens, "greedy", stop_token_ids=[])
        dflash = decoder.generate(prompt, max_new_tokens, "dflash", stop_token_ids=[])
        rows.append({
            "prompt": prompt.tolist(), "tokens": dflash.tokens, "identical_to_greedy": dflash.tokens == greedy.tokens,
            "tau": dflash.tau, "acceptance_histogram": dflash.acceptance_histogram(decoder.manifest.block_size),
            "greedy_tokens_per_second": greedy.tokens_per_second,
            "dflash_tokens_per_second": dflash.tokens_per_second,
        })
        if not as_json:
            shown = repr(codec.decode(dflash.tokens)) if codec else dflash.tokens
            print(f"prompt {index}: {prompt.tolist()} -> {shown}")
            print(f"  tau {dflash.tau:.2f}  identical to greedy: {dflash.tokens == greedy.tokens}  "
                  f"greedy {greedy.tokens_per_second:.0f} tok/s  dflash {dflash.tokens_per_second:.0f} tok/s")
    greedy_tps = float(np.median([r["greedy_tokens_per_second"] for r in rows]))
    dflash_tps = float(np.median([r["dflash_tokens_per_second"] for r in rows]))
    summary = {
        "pair": DEMO_VERSION, "block_size": decoder.manifest.block_size,
        "all_identical_to_greedy": all(r["identical_to_greedy"] for r in rows),
        "tau": float(np.mean([r["tau"] for r in rows])),
        "acceptance_histogram": np.sum([r["acceptance_histogram"] for r in rows], axis=0).tolist(),
        "speedup": dflash_tps / greedy_tps if greedy_tps else 0.0, "prompts": rows,
    }
    if as_json:
        print(json.dumps(summary))
    else:
        print(f"tau {summary['tau']:.2f}; acceptance histogram (1..{summary['block_size']}): "
              f"{summary['acceptance_histogram']}; speedup {summary['speedup']:.2f}x (median tok/s); "
              f"identical to greedy: {summary['all_identical_to_greedy']}")
        print("note: a tiny random pair; its speedup says little about real models.", file=sys.stderr)
    return 0 if summary["all_identical_to_greedy"] else 1
