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
        digest = hashlib.sha256()  # the weights and the tokenizer files the export copies (its chat template)
        for file in sorted([*PAIR_DIR.rglob("*.safetensors"), *PAIR_DIR.rglob("tokenizer*.json")]):
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


def held_out_texts() -> list[str]:
    """Each held-out standard-library file's text from its first `def` line (files this Python lacks skipped)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in json.loads((PAIR_DIR / "held_out_files.json").read_text()):
        path = stdlib / name
        if not path.is_file():  # another Python version may lack a file
            continue
        text = path.read_text(errors="ignore")
        start = text.find("\n    def ") + 1 or text.find("\ndef ") + 1
        if start > 0:
            texts.append(text[start:])
    return texts


def held_out_prompts(count: int) -> list[str]:
    """Code prompts from held-out standard-library files: each starts at a `def` line."""
    return [text[:PROMPT_BYTES] for text in held_out_texts() if len(text) > PROMPT_BYTES][:count]


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


# the demo's columns: (decoding mode, verify, lookup guess in the padding row); JSON keys are the short names
MODES = {"plain_greedy": ("greedy", "full", False), "greedy": ("greedy", "full", True),
         "full": ("dflash", "full", True), "auto": ("dflash", "auto", True)}
COLUMNS = {"plain_greedy": "plain greedy", "greedy": "greedy + lookup guess", "full": "DFlash, full blocks",
           "auto": "DFlash, auto verify"}
ROUNDS = 5  # with 3, the ratios to plain greedy moved up to 72 % over three reruns beside a busy process; with 5, 15 %
WARM_UP_PROMPTS = 2  # untimed requests before the rounds, on prompts of their own


def _round(decoders: dict[str, Decoder], prompts: list, max_new_tokens: int, order: list[str],
           on_tokens=None) -> tuple[dict[str, list], dict[str, float]]:
    """Every mode on every prompt, modes in `order` per prompt: each mode's results and its decode rate."""
    results = {mode: [] for mode in MODES}
    for index, (_, ids) in enumerate(prompts):
        for mode in order:
            decoding, verify, _ = MODES[mode]
            stream = on_tokens(index) if on_tokens is not None and mode == "auto" else None
            results[mode].append(decoders[mode].generate(ids, max_new_tokens, decoding, stop_token_ids=[],
                                                         verify=verify, on_tokens=stream))
            if on_tokens is not None and mode == "auto":
                print(flush=True)
    rates = {mode: sum(len(r.tokens) for r in runs) / max(sum(r.decode_s for r in runs), 1e-9)
             for mode, runs in results.items()}
    return results, rates


def where_dflash_pays(costs, block_size: int, tau: float) -> str:
    """One line: the tau at which a full-block DFlash step beats greedy on this machine's measured costs, and
    what this pair's tau gives there."""
    if costs is None or not costs.verify_ms:
        return "no cost curve recorded: lower the directory to measure where DFlash pays"
    one, block = costs.verify_ms[0], costs.verify_ms[min(block_size, len(costs.verify_ms)) - 1]
    even = (block + costs.draft_ms) / one
    head = (f"where DFlash pays: here a {block_size}-token verify costs {block / one:.1f}x a one-token step and a "
            f"draft step {costs.draft_ms / one:.1f}x, so full blocks pay from tau {even:.1f}")
    if tau > even:
        return f"{head}; this draft's tau {tau:.2f} is above that, so DFlash pays on this machine"
    return (f"{head}; this draft's tau {tau:.2f} is below that, so full blocks lose here (auto verifies fewer "
            "tokens where the draft is unsure); the same draft pays where a verify costs little more than a step "
            "(GPUs, Cloud AI 100)")


def run_demo(as_json: bool = False, max_new_tokens: int = 128, num_prompts: int = 4, rounds: int = ROUNDS) -> int:
    """Plain greedy, greedy with the lookup guess, DFlash with full blocks and with the auto verify policy on
    held-out prompts, in `rounds` interleaved rounds (medians, and how far the rounds moved), each checked
    against plain greedy; the first round's auto run streamed."""
    out = ensure_demo_lowering(ensure_demo_export(progress=not as_json), progress=not as_json)
    decoder = open_decoder(out)
    codec = TextCodec(out) if has_tokenizer(out) else None
    every = _prompts(decoder, codec, num_prompts + WARM_UP_PROMPTS)
    prompts, warm_ups = every[:num_prompts], every[num_prompts:]
    # untimed requests on prompts of their own first: sessions' first-call setup is not decoding speed, and the
    # verify policy learns the pair's acceptance and this machine's step costs over its first drafted steps, as a
    # server's does over its first requests (dflash_onnx/runtime/policy.py)
    for _, ids in warm_ups:
        decoder.generate(ids, max_new_tokens, "dflash", stop_token_ids=[])

    def streamed(index: int):
        text, ids = prompts[index]
        print(f"--- prompt {index + 1} ---\n{text if text is not None else ids}", end="", flush=True)
        stream = TextStream(codec) if codec is not None else None
        return (lambda chunk: print(stream.delta(chunk), end="", flush=True)) if stream else None

    order, per_round = list(MODES), []
    for number in range(rounds):  # each round starts with another mode, so drift on a busy machine spreads evenly
        shown = streamed if number == 0 and not as_json else None
        turn = number % len(order)
        # every round starts from what the warm-up learnt: a round's auto figure is not the sum of the rounds before
        start = decoder.branched()
        decoders = {mode: start.sharing(guess_padding=decoder.guess_padding and guess)
                    for mode, (_, _, guess) in MODES.items()}
        per_round.append(_round(decoders, prompts, max_new_tokens, order[turn:] + order[:turn], shown))
    summary = _summary(decoder, out, prompts, per_round)
    print(json.dumps(summary) if as_json else _table(summary))
    if not as_json and summary["curve_check"]:
        print(f"warning: {summary['curve_check']}", file=sys.stderr)
    if not as_json and not _shipped():
        print("note: a tiny random pair; build the demo pair with benchmarks/build_pair.py", file=sys.stderr)
    return 0 if summary["all_identical_to_greedy"] else 1


def _summary(decoder: Decoder, out: Path, prompts: list, per_round: list) -> dict:
    """Medians over the rounds, how far they moved, tau of full blocks, identity with plain greedy, the cost line."""
    block = decoder.manifest.block_size
    identical = all(runs[i].tokens == per["plain_greedy"][i].tokens for per, _ in per_round for runs in per.values()
                    for i in range(len(prompts)))
    first = per_round[0][0]
    lengths = [length for r in first["full"] for length in r.acceptance_lengths]
    tau = float(np.mean(lengths)) if lengths else 0.0
    rates = {mode: [rates[mode] for _, rates in per_round] for mode in MODES}
    median = {mode: float(np.median(values)) for mode, values in rates.items()}
    moved = {mode: (max(values) - min(values)) / median[mode] if median[mode] else 0.0
             for mode, values in rates.items()}
    guessed = sum(r.guessed for r in first["greedy"])
    return {
        "pair": "shipped stdlib byte-level pair" if _shipped() else "tiny random pair (demo pair not built)",
        "directory": str(out), "block_size": block, "rounds": len(per_round),
        "prompt_tokens": [len(ids) for _, ids in prompts],
        "all_identical_to_greedy": identical, "tau": tau,
        "acceptance_histogram": np.sum([r.acceptance_histogram(block) for r in first["full"]], axis=0).tolist(),
        **{f"{mode}_tokens_per_second": rate for mode, rate in median.items()},
        "moved": moved, "lookup_guesses": {"steps": guessed, "right": sum(r.guessed_right for r in first["greedy"])},
        # paired within each round (the same minutes of a busy machine), then the median over rounds
        **{f"{mode}_vs_plain_greedy": float(np.median([a / b for a, b in zip(rates[mode], rates["plain_greedy"])]))
           for mode in MODES},
        "full_speedup": median["full"] / median["greedy"], "auto_speedup": median["auto"] / median["greedy"],
        "costs": asdict(decoder.costs) if decoder.costs else None,
        "where_dflash_pays": where_dflash_pays(decoder.costs, block, tau),
        "curve_check": decoder.curve_check(*(r for per, _ in per_round for runs in per.values() for r in runs)),
        "prompts": [{"prompt": text if text is not None else ids, "tokens": first["auto"][i].tokens,
                     "tau": first["full"][i].tau} for i, (text, ids) in enumerate(prompts)],
    }


def _table(summary: dict) -> str:
    """The demo's result as a user reads it: one row per way of decoding, named for what it is."""
    rounds, block = summary["rounds"], summary["block_size"]
    shortest, longest = min(summary["prompt_tokens"]), max(summary["prompt_tokens"])
    lengths = f"{shortest}" if shortest == longest else f"{shortest}-{longest}"
    lines = [f"\n{summary['pair']} on ONNX Runtime ({summary['directory']}), {len(summary['prompts'])} prompts of "
             f"{lengths} tokens, medians of {rounds} interleaved rounds",
             f"{'':<24}{'tok/s':>8}{'vs plain greedy':>17}{'rounds moved':>14}  tau (block " f"{block})"]
    guesses = summary["lookup_guesses"]
    for mode, column in COLUMNS.items():
        tau = f"{summary['tau']:.2f}" if mode == "full" else "-"
        if mode == "greedy" and guesses["steps"]:
            tau = f"- (guess right in {guesses['right']} of {guesses['steps']} steps)"
        lines.append(f"{column:<24}{summary[mode + '_tokens_per_second']:>8.0f}"
                     f"{summary[mode + '_vs_plain_greedy']:>16.2f}x{summary['moved'][mode]:>13.0%}  {tau}")
    identical = "yes" if summary["all_identical_to_greedy"] else "NO"
    lines.append(f"tokens identical to plain greedy in every run: {identical}; acceptance histogram 1..{block} "
                 f"(full blocks): {summary['acceptance_histogram']}")
    lines.append(summary["where_dflash_pays"])
    return "\n".join(lines)
