"""`dflash-onnx demo`: the embedded default job, offline.

The shipped pair (dflash_onnx/demo_pair/, rebuilt by benchmarks/build_pair.py) is a byte-level Qwen3 target
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
from dataclasses import asdict
from pathlib import Path

import numpy as np

from dflash_onnx.runtime.decode import Decoder
from dflash_onnx.runtime.manifest import MANIFEST_NAME, load_manifest
from dflash_onnx.runtime.tokenizer import TextCodec, TextStream, has_tokenizer
from dflash_onnx.targets import LowerRequest, get_backend, open_decoder

PAIR_DIR = Path(__file__).parent / "demo_pair"
PROMPT_BYTES = 160


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_ONNX_CACHE") or Path.home() / ".cache" / "dflash-onnx")


def _shipped() -> bool:
    return (PAIR_DIR / "target" / "model.safetensors").is_file() and (PAIR_DIR / "draft" / "config.json").is_file()


def ensure_demo_export(progress: bool = True) -> Path:
    """Export the demo pair unless the cache already holds this version; return the export directory."""
    from dflash_onnx.exporter.export import GRAPH_REVISION, export_pair

    if _shipped():
        digest = hashlib.sha256()
        for file in sorted((PAIR_DIR).rglob("*.safetensors")):
            digest.update(file.read_bytes())
        out = cache_root() / f"demo-stdlib-{digest.hexdigest()[:12]}-g{GRAPH_REVISION}" / "onnx"
        if not (out / MANIFEST_NAME).is_file():
            export_pair(PAIR_DIR / "target", PAIR_DIR / "draft", out, overwrite=True, progress=progress)
        return out
    from dflash_onnx.exporter.tiny import TinySpec, build_pair

    root = cache_root() / f"tiny-agree-v1-g{GRAPH_REVISION}"
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


def ensure_demo_lowering(export: Path, progress: bool = True) -> Path:
    """The demo export lowered for ONNX Runtime (cached beside it): the path it runs fastest on, with the cost
    curve the auto verify policy weighs measured at lowering. The draft runs on one thread (a few MB of draft:
    its calls are too short to split)."""
    ort = get_backend("ort")
    out = Path(export).parent / "ort"
    if not _current_lowering(out):
        ort.lower(Path(export), out, ort.options({"--draft-threads": 1}), LowerRequest(overwrite=True,
                                                                                     progress=progress))
    return out


def _current_lowering(directory: Path) -> bool:
    """A cached lowering this version can use as it is: one written before lowerings measured their row multiple
    (batch invariance) is lowered again."""
    if not (directory / MANIFEST_NAME).is_file():
        return False
    lowering = load_manifest(directory).lowering
    return lowering is not None and "batch_invariance" in lowering.report


MODES = {"greedy": ("greedy", "full"), "full": ("dflash", "full"), "auto": ("dflash", "auto")}


def run_demo(as_json: bool = False, max_new_tokens: int = 128, num_prompts: int = 4) -> int:
    """Greedy, DFlash with full blocks and DFlash with the auto verify policy on held-out prompts, side by
    side (the auto run streamed), each checked against greedy."""
    out = ensure_demo_lowering(ensure_demo_export(progress=not as_json), progress=not as_json)
    decoder = open_decoder(out)
    codec = TextCodec(out) if has_tokenizer(out) else None
    *prompts, (_, warm_up) = _prompts(decoder, codec, num_prompts + 1)
    # one untimed request on a prompt of its own first: sessions' first-call setup is not decoding speed, and the
    # verify policy learns this machine's step costs over its first drafted steps, as a server's does over its
    # first requests (dflash_onnx/runtime/policy.py)
    decoder.generate(warm_up, max_new_tokens, "dflash", stop_token_ids=[])
    rows, totals, every = [], {mode: [0, 0.0] for mode in MODES}, []
    for index, (text, ids) in enumerate(prompts):
        if not as_json:
            print(f"--- prompt {index + 1} ---\n{text if text is not None else ids}", end="", flush=True)
        stream = TextStream(codec) if codec is not None and not as_json else None
        on_tokens = (lambda chunk, stream=stream: print(stream.delta(chunk), end="", flush=True)) if stream else None
        results = {"auto": decoder.generate(ids, max_new_tokens, "dflash", stop_token_ids=[], on_tokens=on_tokens)}
        for mode in ("greedy", "full"):
            results[mode] = decoder.generate(ids, max_new_tokens, MODES[mode][0], stop_token_ids=[],
                                             verify=MODES[mode][1])
        every += results.values()
        for mode, result in results.items():
            totals[mode][0] += len(result.tokens)
            totals[mode][1] += result.decode_s
        greedy, full, auto = results["greedy"], results["full"], results["auto"]
        rows.append({"prompt": text if text is not None else ids, "tokens": auto.tokens,
                     "identical_to_greedy": auto.tokens == greedy.tokens == full.tokens, "tau": full.tau,
                     "acceptance_lengths": full.acceptance_lengths,
                     "acceptance_histogram": full.acceptance_histogram(decoder.manifest.block_size),
                     **{f"{mode}_tokens_per_second": r.tokens_per_second for mode, r in results.items()}})
        if not as_json:
            print(f"\n    [identical to greedy: {rows[-1]['identical_to_greedy']}; greedy "
                  f"{greedy.tokens_per_second:.0f} tok/s, full blocks {full.tokens_per_second:.0f} tok/s (tau "
                  f"{full.tau:.2f}), auto {auto.tokens_per_second:.0f} tok/s]")
    rates = {mode: count / seconds if seconds else 0.0 for mode, (count, seconds) in totals.items()}
    lengths = [length for row in rows for length in row["acceptance_lengths"]]  # tau over every full-block step
    costs = decoder.costs
    summary = {
        "pair": "shipped stdlib byte-level pair" if _shipped() else "tiny random pair (demo pair not built)",
        "directory": str(out), "block_size": decoder.manifest.block_size,
        "all_identical_to_greedy": all(r["identical_to_greedy"] for r in rows),
        "tau": float(np.mean(lengths)),
        "acceptance_histogram": np.sum([r["acceptance_histogram"] for r in rows], axis=0).tolist(),
        **{f"{mode}_tokens_per_second": rate for mode, rate in rates.items()},
        "full_speedup": rates["full"] / rates["greedy"] if rates["greedy"] else 0.0,
        "auto_speedup": rates["auto"] / rates["greedy"] if rates["greedy"] else 0.0,
        "costs": asdict(costs) if costs else None,
        "curve_check": decoder.curve_check(*every),
        "prompts": rows,
    }
    if as_json:
        print(json.dumps(summary))
    else:
        print(f"\n{summary['pair']} on ONNX Runtime ({out}): tau {summary['tau']:.2f} (block "
              f"{summary['block_size']}); acceptance histogram 1..{summary['block_size']}: "
              f"{summary['acceptance_histogram']}")
        print(f"greedy {rates['greedy']:.0f} tok/s; DFlash full blocks {rates['full']:.0f} tok/s "
              f"({summary['full_speedup']:.2f}x); DFlash auto {rates['auto']:.0f} tok/s "
              f"({summary['auto_speedup']:.2f}x) (decode time, all prompts); identical to greedy: "
              f"{summary['all_identical_to_greedy']}")
        if costs:
            print("cost curve the auto policy weighed (ms, measured at lowering): t(T) for T = 1..B "
                  + " ".join(f"{t:.3g}" for t in costs.verify_ms) + f"; draft step {costs.draft_ms:.3g}")
        if summary["curve_check"]:
            print(f"warning: {summary['curve_check']}", file=sys.stderr)
        if not _shipped():
            print("note: a tiny random pair; build the demo pair with benchmarks/build_pair.py", file=sys.stderr)
    return 0 if summary["all_identical_to_greedy"] else 1
