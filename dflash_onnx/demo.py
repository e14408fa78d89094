"""`dflash-onnx demo`: the embedded default job, offline.

The shipped pair (dflash_onnx/demo_pair/, rebuilt by demo/build_pair.py) is a byte-level Qwen3 target
trained on the Python standard library and its distilled DFlash draft. The demo exports it once (cached),
takes code prompts from standard-library files both models never saw (the held-out split), streams each
DFlash completion, checks it against greedy decoding and prints tau, the acceptance histogram and the
measured speedup. Without the shipped pair (a source checkout that has not built it) it falls back to a
tiny random pair whose draft is biased to agree with its target.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from targets import open_decoder

from .decode import Decoder
from .manifest import MANIFEST_NAME
from .tokenizer import TextCodec, TextStream, has_tokenizer

PAIR_DIR = Path(__file__).parent / "demo_pair"
PROMPT_BYTES = 160


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_ONNX_CACHE") or Path.home() / ".cache" / "dflash-onnx")


def _shipped() -> bool:
    return (PAIR_DIR / "target" / "model.safetensors").is_file() and (PAIR_DIR / "draft" / "config.json").is_file()


def ensure_demo_export(progress: bool = True) -> Path:
    """Export the demo pair unless the cache already holds this version; return the export directory."""
    from .export import export_pair

    if _shipped():
        digest = hashlib.sha256()
        for file in sorted((PAIR_DIR).rglob("*.safetensors")):
            digest.update(file.read_bytes())
        out = cache_root() / f"demo-stdlib-{digest.hexdigest()[:12]}" / "onnx"
        if not (out / MANIFEST_NAME).is_file():
            export_pair(PAIR_DIR / "target", PAIR_DIR / "draft", out, overwrite=True, progress=progress)
        return out
    from .tiny import TinySpec, build_pair

    root = cache_root() / "tiny-agree-v1"
    out = root / "onnx"
    if not (out / MANIFEST_NAME).is_file():
        spec = TinySpec(agree=True, tie_embeddings=False, block_size=8, target_layers=4, draft_layers=1)
        target_dir, draft_dir = build_pair(spec, root / "pair")
        export_pair(target_dir, draft_dir, out, overwrite=True, progress=progress)
    return out


def held_out_prompts(count: int) -> list[str]:
    """Code prompts from held-out standard-library files: each starts at a `def` line."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = json.loads((PAIR_DIR / "held_out_files.json").read_text())
    prompts = []
    for name in names:
        path = stdlib / name
        if not path.is_file():  # another Python version may lack a file
            continue
        text = path.read_text(errors="ignore")
        start = text.find("\n    def ") + 1 or text.find("\ndef ") + 1
        if start > 0 and len(text) > start + PROMPT_BYTES:
            prompts.append(text[start : start + PROMPT_BYTES])
        if len(prompts) == count:
            break
    return prompts


def _prompts(decoder: Decoder, codec: TextCodec | None, count: int) -> list[tuple[str | None, list[int]]]:
    if _shipped() and codec is not None:
        return [(text, codec.encode(text)) for text in held_out_prompts(count)]
    rng = np.random.default_rng(0)
    return [(None, rng.integers(2, decoder.manifest.vocab_size - 1, size=6).tolist()) for _ in range(count)]


def run_demo(as_json: bool = False, max_new_tokens: int = 128, num_prompts: int = 4) -> int:
    out = ensure_demo_export(progress=not as_json)
    decoder = open_decoder(out)
    codec = TextCodec(out) if has_tokenizer(out) else None
    prompts = _prompts(decoder, codec, num_prompts)
    decoder.generate(prompts[0][1], 4, "dflash", stop_token_ids=[])  # first-call setup is not decoding speed
    rows, totals = [], {"greedy": [0, 0.0], "dflash": [0, 0.0]}
    for index, (text, ids) in enumerate(prompts):
        if not as_json:
            print(f"--- prompt {index + 1} ---\n{text if text is not None else ids}", end="", flush=True)
        stream = TextStream(codec) if codec is not None and not as_json else None
        on_tokens = (lambda chunk, stream=stream: print(stream.delta(chunk), end="", flush=True)) if stream else None
        dflash = decoder.generate(ids, max_new_tokens, "dflash", stop_token_ids=[], on_tokens=on_tokens)
        greedy = decoder.generate(ids, max_new_tokens, "greedy", stop_token_ids=[])
        for mode, result in (("greedy", greedy), ("dflash", dflash)):
            totals[mode][0] += len(result.tokens)
            totals[mode][1] += result.decode_s
        rows.append({"prompt": text if text is not None else ids, "tokens": dflash.tokens,
                     "identical_to_greedy": dflash.tokens == greedy.tokens, "tau": dflash.tau,
                     "acceptance_lengths": dflash.acceptance_lengths,
                     "acceptance_histogram": dflash.acceptance_histogram(decoder.manifest.block_size),
                     "greedy_tokens_per_second": greedy.tokens_per_second,
                     "dflash_tokens_per_second": dflash.tokens_per_second})
        if not as_json:
            print(f"\n    [tau {dflash.tau:.2f}; identical to greedy: {dflash.tokens == greedy.tokens}; "
                  f"greedy {greedy.tokens_per_second:.0f} tok/s, dflash {dflash.tokens_per_second:.0f} tok/s]")
    greedy_tps = totals["greedy"][0] / totals["greedy"][1] if totals["greedy"][1] else 0.0
    dflash_tps = totals["dflash"][0] / totals["dflash"][1] if totals["dflash"][1] else 0.0
    lengths = [length for row in rows for length in row["acceptance_lengths"]]  # tau over every step
    summary = {
        "pair": "shipped stdlib byte-level pair" if _shipped() else "tiny random pair (demo pair not built)",
        "block_size": decoder.manifest.block_size,
        "all_identical_to_greedy": all(r["identical_to_greedy"] for r in rows),
        "tau": float(np.mean(lengths)),
        "acceptance_histogram": np.sum([r["acceptance_histogram"] for r in rows], axis=0).tolist(),
        "greedy_tokens_per_second": greedy_tps, "dflash_tokens_per_second": dflash_tps,
        "speedup": dflash_tps / greedy_tps if greedy_tps else 0.0, "prompts": rows,
    }
    if as_json:
        print(json.dumps(summary))
    else:
        print(f"\n{summary['pair']}: tau {summary['tau']:.2f} (block {summary['block_size']}); acceptance "
              f"histogram 1..{summary['block_size']}: {summary['acceptance_histogram']}")
        print(f"greedy {greedy_tps:.0f} tok/s, DFlash {dflash_tps:.0f} tok/s: speedup {summary['speedup']:.2f}x "
              f"(decode time, all prompts); identical to greedy: {summary['all_identical_to_greedy']}")
        if not _shipped():
            print("note: a tiny random pair; build the demo pair with demo/build_pair.py", file=sys.stderr)
    return 0 if summary["all_identical_to_greedy"] else 1
