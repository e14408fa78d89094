"""`dflash-onnx bench`: the figures a user compares when choosing a speculative decoding stack.

Per prompt and in aggregate: greedy and DFlash tokens/s (decode only, the reference's definition, and end
to end), speedup, tau and its histogram, TTFT, and the loop overhead (share of decode wall time spent
outside backend calls). The verify-cost curve (median target step time for T new tokens at several
context lengths, plus the draft step) gives the speedup those step times imply at the measured tau,
printed next to the measured one. Greedy and DFlash runs alternate so machine noise hits both alike.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from dflash_onnx.figures import figures_record, render
from dflash_onnx.runtime.costs import DRAFT_OUTPUTS, TARGET_OUTPUTS, call_ms, measurable
from dflash_onnx.runtime.decode import Decoder
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.feeds import draft_feeds, target_feeds
from dflash_onnx.runtime.manifest import CostModel, Manifest, load_manifest
from dflash_onnx.runtime.sampling import SamplingParams
from dflash_onnx.runtime.tokenizer import TextCodec, has_tokenizer
from dflash_onnx.targets import backend_for, open_decoder


@dataclass
class BenchOptions:
    max_new_tokens: int = 128
    repeats: int = 3
    num_prompts: int = 4
    verify_lengths: list[int] | None = None  # None: 1, 2, 4, ... up to and including block_size
    contexts: list[int] | None = None  # None: DEFAULT_CONTEXTS, those the lowering holds a verify beyond
    curve_repeats: int = 10
    verify: str | int = "auto"  # the DFlash runs' verify policy; with auto, full blocks are measured beside it
    load: int = 0  # busy processes beside a second, loaded measurement of the runs (and peers)
    llama_cpp: Path | None = None  # the llama.cpp source tree (built) for --peers llama.cpp; None: built once, cached
    llama_cpp_type: str | None = None  # llama-quantize's type for --peers llama.cpp; None: the one matching ours
    prompt_tokens: list[int] | None = None  # measure at these prompt lengths (held-out code cut to length)
    batch_invariant: bool = True  # pad target calls to the lowering's row multiple (decode.Decoder)
    lookup_guess: bool = True  # a lookup guess in the padding row of a one-token step (decode.Decoder)
    session_overrides: dict = field(default_factory=dict)  # the backend's session options (CoreML: compute_units)


DEFAULT_CONTEXTS = (256, 1024)


def curve_contexts(given: list[int] | None, capacity: int | None, longest_call: int) -> list[int]:
    """The cost curve's contexts: those given (each must leave room for the longest call after it, refused in one
    line before any run), or the default ones that do (at least the first, shortened to fit)."""
    if given is None:
        fitting = [c for c in DEFAULT_CONTEXTS if capacity is None or c + longest_call <= capacity]
        return fitting or [max(0, min(DEFAULT_CONTEXTS[0], (capacity or 0) - longest_call))]
    if capacity is not None:
        over = [c for c in given if c + longest_call > capacity]
        if over:
            raise DFlashError(f"--contexts {','.join(map(str, over))}: a cost-curve call there reads up to "
                              f"{max(over) + longest_call} positions, and this lowering holds {capacity}: give "
                              f"contexts up to {capacity - longest_call}, or lower with a larger --ctx-len")
    return given


class ClockedSession:
    """A Session that adds up the seconds spent inside run(); everything else is the wrapped session's."""

    def __init__(self, session):
        self._session = session
        self.seconds = 0.0

    def __getattr__(self, name):
        return getattr(self._session, name)

    def run(self, feeds, output_names=None):
        started = time.perf_counter()
        try:
            return self._session.run(feeds, output_names)
        finally:
            self.seconds += time.perf_counter() - started


def default_verify_lengths(block_size: int) -> list[int]:
    lengths, t = [], 1
    while t < block_size:
        lengths.append(t)
        t *= 2
    return lengths + [block_size]


def load_prompts(path: Path | None, codec: TextCodec | None, count: int, vocab_size: int) -> list[dict]:
    """Prompts as {"text", "ids"}: from a file (one prompt per line, or JSONL with "prompt" or "ids"), else
    held-out standard-library code when the directory has a tokenizer, else seeded random ids."""
    from dflash_onnx.demo import held_out_prompts

    if path is not None:
        if not Path(path).is_file():
            raise DFlashError(f"--prompts {path}: no such file")
        try:
            lines = Path(path).read_bytes().decode("utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise DFlashError(f"--prompts {path} is not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
        prompts = []
        for number, line in enumerate(lines, 1):
            if line.strip():
                prompts.append(_prompt_line(line, f"{path}:{number}", Path(path).suffix == ".jsonl", codec,
                                            vocab_size))
        if not prompts:
            raise DFlashError(f"--prompts {path} holds no prompts")
        return prompts
    if codec is not None:
        return [{"text": text, "ids": codec.encode(text)} for text in held_out_prompts(count)]
    rng = np.random.default_rng(0)
    return [{"text": None, "ids": rng.integers(2, vocab_size - 1, size=16).tolist()} for _ in range(count)]


def depth_prompts(codec: TextCodec | None, count: int, tokens: int, vocab_size: int) -> list[dict]:
    """`count` prompts of exactly `tokens` ids, as users send them (a long file, a history): held-out
    standard-library code, files joined where one is shorter, cut to length; seeded random ids without a
    tokenizer."""
    from dflash_onnx.demo import held_out_texts

    if codec is None:
        rng = np.random.default_rng(tokens)
        return [{"text": None, "ids": rng.integers(2, vocab_size - 1, size=tokens).tolist()} for _ in range(count)]
    texts, prompts, next_text = held_out_texts(), [], 0
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < tokens:
            ids += codec.encode(texts[next_text % len(texts)])
            next_text += 1
        prompts.append({"text": f"{tokens} tokens of held-out code", "ids": ids[:tokens]})
    return prompts


def _prompt_line(line: str, where: str, jsonl: bool, codec: TextCodec | None, vocab_size: int) -> dict:
    """One prompt file line: text, or in a .jsonl file an object with "prompt" (text) or "ids" (integers)."""
    text, ids = line.replace("\\n", "\n"), None
    if jsonl:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            entry = None
        if not isinstance(entry, dict):
            raise DFlashError(f'{where}: not a JSON object: write {{"prompt": "text"}} or {{"ids": [1, 2, 3]}}')
        text, ids = entry.get("prompt"), entry.get("ids")
        if text is not None and not isinstance(text, str):
            raise DFlashError(f'{where}: "prompt" must be a string')
        if ids is not None and (not isinstance(ids, list) or not all(type(i) is int for i in ids)):
            raise DFlashError(f'{where}: "ids" must be a list of integers, like [785, 3974]')
    if ids is None:
        if text is None:
            raise DFlashError(f'{where}: give "prompt" (text) or "ids"')
        if codec is None:
            raise DFlashError(f"{where}: text prompts need tokenizer.json in the directory; "
                              "give token ids in a .jsonl file instead")
        ids = codec.encode(text)
    if not ids or min(ids) < 0 or max(ids) >= vocab_size:
        raise DFlashError(f"{where}: prompt ids must be non-empty and lie in 0..{vocab_size - 1}")
    return {"text": text, "ids": list(map(int, ids))}


def _timed_run(decoder: Decoder, clocks: list[ClockedSession], ids: list[int], max_new_tokens: int, mode: str,
               verify: str | int, batch_invariant: bool, guess: bool = True):
    """One generation; returns (result, seconds spent in backend calls during decode, prefill excluded)."""
    variant = decoder.sharing(batch_invariant=batch_invariant, guess_padding=guess and decoder.guess_padding)
    steps = variant.stream(ids, max_new_tokens, mode, stop_token_ids=[], verify=verify)
    next(steps)  # prefill and the first token
    in_backend = -sum(c.seconds for c in clocks)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, in_backend + sum(c.seconds for c in clocks)


def bench_modes(decoder: Decoder, options: BenchOptions) -> dict[str, tuple]:
    """What each measured mode runs (mode, verify, batch-invariant[, lookup guess]): greedy, DFlash with the chosen
    verify policy, full blocks beside an adaptive policy (to show what it buys), and where the decoder pads calls
    for batch invariance, greedy without the padding (the fastest plain greedy, what DFlash must beat) and greedy
    padded without the padding row's lookup guess (what the guess buys)."""
    invariant = decoder.batch_invariant
    modes = {"greedy": ("greedy", "full", invariant), "dflash": ("dflash", options.verify, invariant)}
    if options.verify != "full" and decoder.costs is not None:
        modes["full"] = ("dflash", "full", invariant)
    if decoder.row_multiple > 1:
        modes["greedy_unpadded"] = ("greedy", "full", False)
    if decoder.guesses(SamplingParams()):
        modes["greedy_unguessed"] = ("greedy", "full", invariant, False)
    return modes


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first token that differs from `reference` (a length difference counts); None if equal."""
    for index, (got, want) in enumerate(zip(tokens, reference)):
        if got != want:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def measure_generation(decoder: Decoder, prompts: list[dict], options: BenchOptions, bar=None) -> list[dict]:
    """Greedy and DFlash per prompt, in rotating order, `repeats` times; medians of the timings."""
    clocks = [ClockedSession(decoder.target), ClockedSession(decoder.draft)]
    clocked = decoder.sharing(target=clocks[0], draft=clocks[1])
    block = decoder.manifest.verify_rows  # the most tokens a step commits
    modes = bench_modes(decoder, options)
    rows = []
    clocked.generate(prompts[0]["ids"], min(8, options.max_new_tokens), "dflash", stop_token_ids=[])  # warm-up
    for prompt in prompts:
        runs: dict[str, list] = {mode: [] for mode in modes}
        for repeat in range(options.repeats):
            order = list(modes)[repeat % len(modes):] + list(modes)[: repeat % len(modes)]
            for mode in order:
                runs[mode].append(_timed_run(clocked, clocks, prompt["ids"], options.max_new_tokens, *modes[mode]))
                if bar is not None:
                    bar.update(1)
        rows.append(_prompt_row(prompt, runs, block))
    return rows


def _prompt_row(prompt: dict, runs: dict[str, list], block: int) -> dict:
    row: dict = {"prompt": prompt["text"] if prompt["text"] is not None else prompt["ids"],
                 "prompt_ids": prompt["ids"]}
    for mode, results in runs.items():
        first = results[0][0]
        decode_s = float(np.median([r.decode_s for r, _ in results]))
        ttft_s = float(np.median([r.ttft_s for r, _ in results]))
        in_backend = float(np.median([b for _, b in results]))
        row[mode] = {
            "tokens": len(first.tokens), "decode_s": decode_s, "ttft_s": ttft_s, "backend_s": in_backend,
            "tokens_per_second": len(first.tokens) / decode_s,
            "end_to_end_tokens_per_second": len(first.tokens) / (decode_s + ttft_s),
            "loop_overhead": max(0.0, 1 - in_backend / decode_s),
            "acceptance_lengths": first.acceptance_lengths, "tau": first.tau,
            "acceptance_histogram": first.acceptance_histogram(block),
            "drafted_steps": sum(1 for v in first.verified if v),
            "guessed": first.guessed, "guessed_right": first.guessed_right,
            "verified_mean": float(np.mean(first.verified or [0])),
        }
        row[f"{mode}_token_ids"] = first.tokens
    greedy = row.pop("greedy_token_ids")
    row["first_divergence"] = {mode: first_divergence(row.pop(f"{mode}_token_ids"), greedy)
                               for mode in runs if mode != "greedy"}
    # the padded runs must all be greedy's tokens: DFlash's, and the padded greedy's without the lookup guess
    row["identical_to_greedy"] = all(row["first_divergence"][mode] is None
                                     for mode in ("dflash", "full", "greedy_unguessed") if mode in runs)
    row["tokens"] = greedy
    row["speedup"] = row["dflash"]["tokens_per_second"] / row["greedy"]["tokens_per_second"]
    if "greedy_unpadded" in row:  # against the fastest greedy, whose tokens may differ at near ties
        row["speedup_vs_unpadded"] = row["dflash"]["tokens_per_second"] / row["greedy_unpadded"]["tokens_per_second"]
    if "full" in row:
        row["full_speedup"] = row["full"]["tokens_per_second"] / row["greedy"]["tokens_per_second"]
    return row


def aggregate(rows: list[dict], block: int) -> dict:
    summary: dict = {}
    for mode in [m for m in ("greedy", "dflash", "full", "greedy_unpadded", "greedy_unguessed") if m in rows[0]]:
        tokens = sum(r[mode]["tokens"] for r in rows)
        decode_s = sum(r[mode]["decode_s"] for r in rows)
        ttft_s = sum(r[mode]["ttft_s"] for r in rows)
        summary[mode] = {
            "tokens": tokens, "tokens_per_second": tokens / decode_s,
            "end_to_end_tokens_per_second": tokens / (decode_s + ttft_s),
            "ttft_ms_median": 1000 * float(np.median([r[mode]["ttft_s"] for r in rows])),
            "loop_overhead": max(0.0, 1 - sum(r[mode]["backend_s"] for r in rows) / decode_s),
        }
    lengths = [n for r in rows for n in r["dflash"]["acceptance_lengths"]]
    summary["tau"] = float(np.mean(lengths)) if lengths else 0.0
    summary["acceptance_histogram"] = np.sum([r["dflash"]["acceptance_histogram"] for r in rows], axis=0).tolist()
    summary["speedup"] = summary["dflash"]["tokens_per_second"] / summary["greedy"]["tokens_per_second"]
    summary["end_to_end_speedup"] = (summary["dflash"]["end_to_end_tokens_per_second"]
                                     / summary["greedy"]["end_to_end_tokens_per_second"])
    if "full" in summary:
        summary["full_speedup"] = summary["full"]["tokens_per_second"] / summary["greedy"]["tokens_per_second"]
        summary["full_tau"] = float(np.mean([n for r in rows for n in r["full"]["acceptance_lengths"]]))
    summary["all_identical_to_greedy"] = all(r["identical_to_greedy"] for r in rows)
    if "greedy_unpadded" in summary:
        summary["speedup_vs_unpadded"] = (summary["dflash"]["tokens_per_second"]
                                          / summary["greedy_unpadded"]["tokens_per_second"])
    # per run kind: the share of prompts whose tokens equal greedy's, and of tokens before the first difference
    summary["agreement"] = {mode: {"prompts": float(np.mean([r["first_divergence"][mode] is None for r in rows])),
                                   "tokens": sum(len(r["tokens"]) if r["first_divergence"][mode] is None
                                                 else r["first_divergence"][mode] for r in rows)
                                   / max(1, sum(len(r["tokens"]) for r in rows))}
                            for mode in rows[0]["first_divergence"]}
    return summary


def measure_curve(decoder: Decoder, options: BenchOptions, bar=None) -> dict:
    """Median target step ms for each verify length T at each context, and the draft step. Each call runs
    back to back (as greedy decoding's steps do), so the curve is each call's warm cost; in a DFlash round
    the draft and verify calls alternate and cost somewhat more, which the measured speedup includes."""
    manifest: Manifest = decoder.manifest
    reason = measurable(manifest)
    if reason is not None:
        return {"skipped": reason}
    lengths = options.verify_lengths or default_verify_lengths(manifest.block_size)
    calls = []
    for context in options.contexts:
        calls += [(context, t, decoder.target, target_feeds(manifest, context, t)) for t in lengths]
        calls.append((context, "draft", decoder.draft, draft_feeds(manifest, context)))
    median: dict = {}
    for context, kind, session, feeds in calls:
        names = DRAFT_OUTPUTS if kind == "draft" else TARGET_OUTPUTS
        median[(context, kind)] = call_ms(session, feeds, names, options.curve_repeats)
        if bar is not None:
            bar.update(1)
    return {"verify_lengths": lengths, "contexts": options.contexts,
            "target_ms": {str(c): [median[(c, t)] for t in lengths] for c in options.contexts},
            "draft_ms": {str(c): median[(c, "draft")] for c in options.contexts}}


def implied_speedups(curve: dict, tau: float, block: int) -> dict:
    """Per context: tau * t(1) / (t(block) + draft), the speedup the step times imply, and the tau at
    which DFlash breaks even, (t(block) + draft) / t(1)."""
    if "skipped" in curve or 1 not in curve["verify_lengths"] or block not in curve["verify_lengths"]:
        return {}
    one, full = curve["verify_lengths"].index(1), curve["verify_lengths"].index(block)
    out = {}
    for context, times in curve["target_ms"].items():
        round_ms = times[full] + curve["draft_ms"][context]
        out[context] = {"implied_speedup": tau * times[one] / round_ms, "break_even_tau": round_ms / times[one]}
    return out


def run_bench(directory: Path, backend: str | None, prompts_file: Path | None, options: BenchOptions,
              peers: list[str], checkpoints: tuple[Path | None, Path | None], progress: bool = True,
              costs: CostModel | None = None) -> dict:
    """Every figure of `dflash-onnx bench`; `costs` replaces the directory's recorded cost curve."""
    from tqdm import tqdm

    manifest = load_manifest(directory)
    bad = [t for t in options.verify_lengths or [] if not 1 <= t <= manifest.block_size]
    if bad:
        raise DFlashError(f"verify lengths must lie in 1..{manifest.block_size} (the block size), got {bad}")
    if peers:
        from dflash_onnx.peers import check_peer_names

        check_peer_names(peers)
    if options.llama_cpp_type:
        from dflash_onnx.llama_cpp.gguf import named_precision

        if "llama.cpp" not in peers:
            raise DFlashError("--llama-cpp-type names the type --peers llama.cpp runs: add --peers llama.cpp")
        named_precision(manifest, options.llama_cpp_type)  # an unknown type is refused before any run
    backend = backend_for(directory, manifest, backend).name
    decoder = open_decoder(directory, backend=backend, batch_invariant=options.batch_invariant,
                           guess_padding=options.lookup_guess, costs=costs, **options.session_overrides)
    codec = TextCodec(directory) if has_tokenizer(directory) else None
    sets = _prompt_sets(decoder, codec, prompts_file, options)
    lengths = options.verify_lengths or default_verify_lengths(manifest.block_size)
    longest = max(*lengths, manifest.verify_rows)  # the longest target call, or the draft's block
    options = replace(options, contexts=curve_contexts(options.contexts, decoder.capacity, longest))
    curve_calls = len(options.contexts) * (len(lengths) + 1) if manifest.form in ("concat", "buffer") else 0
    runs = len(bench_modes(decoder, options)) * options.repeats * sum(len(prompts) for _, prompts in sets)
    with tqdm(total=runs + curve_calls, disable=not progress, desc="bench", unit="run", file=sys.stderr) as bar:
        measured = [measure_generation(decoder, prompts, options, bar) for _, prompts in sets]
        curve = measure_curve(decoder, options, bar)
    rows = measured[0]
    summary = aggregate(rows, manifest.block_size)
    report = {
        "directory": str(directory), "backend": backend, "block_size": manifest.block_size,
        "passes": [p["name"] for p in manifest.passes], "lowering": manifest.backend,
        "max_new_tokens": options.max_new_tokens, "repeats": options.repeats, "verify": options.verify,
        "batch_invariant": decoder.batch_invariant, "row_multiple": decoder.row_multiple,
        "costs": asdict(decoder.costs) if decoder.costs else None,
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "python": platform.python_version(), **_library_versions()},
        "aggregate": summary, "prompts": rows, "curve": curve,
        "implied": implied_speedups(curve, summary.get("full_tau", summary["tau"]), manifest.block_size),
    }
    if options.prompt_tokens:
        report["depths"] = [depth_summary(tokens, set_rows, manifest.block_size)
                            for (tokens, _), set_rows in zip(sets, measured)]
    for index, ((_, set_prompts), set_rows) in enumerate(zip(sets, measured)):  # peers at each depth, as ours
        if peers:
            from dflash_onnx.peers import run_peers

            found = run_peers(manifest, set_prompts, options, peers, *checkpoints,
                              ours=aggregate(set_rows, manifest.block_size),
                              our_tokens=[row["tokens"] for row in set_rows], progress=progress)
            report["peers"] = report.get("peers", found)
            if options.prompt_tokens:
                report["depths"][index]["peers"] = found
        if options.load:
            loaded = _loaded(decoder, set_prompts, options, peers, checkpoints, progress)
            report["loaded"] = report.get("loaded", loaded)
            if options.prompt_tokens:
                report["depths"][index]["loaded"] = loaded
    return report


def _prompt_sets(decoder: Decoder, codec: TextCodec | None, prompts_file: Path | None,
                 options: BenchOptions) -> list[tuple[int | None, list[dict]]]:
    """(prompt length, prompts) per measured set: one per --prompt-tokens length, or the prompts given (a file,
    else held-out code of 160 characters)."""
    manifest = decoder.manifest
    if not options.prompt_tokens:
        return [(None, load_prompts(prompts_file, codec, options.num_prompts, manifest.vocab_size))]
    if prompts_file is not None:
        raise DFlashError("--prompts and --prompt-tokens both choose the prompts: give one")
    bad = [n for n in options.prompt_tokens if n < 1]
    reach = max(options.prompt_tokens) + options.max_new_tokens + manifest.verify_rows
    if bad:
        raise DFlashError(f"--prompt-tokens must be positive, got {','.join(map(str, bad))}")
    if decoder.capacity is not None and reach > decoder.capacity:
        raise DFlashError(f"--prompt-tokens {max(options.prompt_tokens)} with {options.max_new_tokens} new tokens "
                          f"reaches {reach} positions, and this lowering holds {decoder.capacity}: lower with "
                          f"--ctx-len {reach} or more, or measure shorter prompts")
    return [(n, depth_prompts(codec, options.num_prompts, n, manifest.vocab_size)) for n in options.prompt_tokens]


def depth_summary(tokens: int, rows: list[dict], block: int) -> dict:
    """One prompt length's figures: the aggregate of its runs, time to first token and the prefill rate it implies
    (the prompt over the first token's time), and decoding at that depth per mode."""
    summary = aggregate(rows, block)
    plain = "greedy_unpadded" if "greedy_unpadded" in summary else "greedy"
    ttft_s = float(np.median([row[plain]["ttft_s"] for row in rows]))
    return {"prompt_tokens": tokens, "ttft_ms": 1000 * ttft_s, "prefill_tokens_per_second": tokens / ttft_s,
            "one_row_greedy": plain, "aggregate": summary, "prompts": rows}


def _loaded(decoder: Decoder, prompts: list[dict], options: BenchOptions, peers: list[str],
            checkpoints: tuple[Path | None, Path | None], progress: bool) -> dict:
    """The runs (and peers) again with `options.load` busy processes beside them, started and ended here."""
    from tqdm import tqdm

    from dflash_onnx.runtime.busy import busy_processes

    manifest = decoder.manifest
    total = len(bench_modes(decoder, options)) * options.repeats * len(prompts)
    with busy_processes(options.load) as pids:
        if progress:
            print(f"bench: {options.load} busy process(es) started (pid {', '.join(map(str, pids))})",
                  file=sys.stderr, flush=True)
        with tqdm(total=total, disable=not progress, desc="bench (loaded)", unit="run", file=sys.stderr) as bar:
            rows = measure_generation(decoder, prompts, options, bar)
        loaded = {"load": options.load, "aggregate": aggregate(rows, manifest.block_size), "prompts": rows}
        if peers:
            from dflash_onnx.peers import run_peers

            loaded["peers"] = run_peers(manifest, prompts, options, peers, *checkpoints, ours=loaded["aggregate"],
                                        our_tokens=[row["tokens"] for row in rows], progress=progress)
    return loaded


def quiet_and_loaded(report: dict) -> list[dict]:
    """Per run kind (ours and each peer): tokens/s quiet and loaded, and the loaded change."""
    loaded = report["loaded"]
    ours = ("greedy", "greedy_unpadded", "greedy_unguessed", "dflash", "full")
    quiet_rows = {m: report["aggregate"][m] for m in ours if m in report["aggregate"]}
    loaded_rows = {m: loaded["aggregate"][m] for m in quiet_rows}
    for quiet_peer, loaded_peer in zip(report.get("peers", {}).get("rows", []),
                                       loaded.get("peers", {}).get("rows", [])):
        if "unavailable" in quiet_peer or "unavailable" in loaded_peer:
            continue
        quiet_rows[quiet_peer["name"]], loaded_rows[loaded_peer["name"]] = quiet_peer, loaded_peer
    return [{"name": f"ours {name.replace('_', ' ')}" if name in ours else name,
             "quiet": quiet_rows[name]["tokens_per_second"], "loaded": loaded_rows[name]["tokens_per_second"],
             "change": loaded_rows[name]["tokens_per_second"] / quiet_rows[name]["tokens_per_second"] - 1}
            for name in quiet_rows]


def _library_versions() -> dict:
    import onnxruntime

    return {"onnxruntime": onnxruntime.__version__}


def format_report(report: dict) -> str:
    agg, block = report["aggregate"], report["block_size"]
    lines = [f"{report['directory']} on {report['backend']} (block {block}, {report['max_new_tokens']} new tokens, "
             f"median of {report['repeats']} runs, DFlash verify {report.get('verify', 'full')})", "",
             f"{'prompt':<7} {'tokens':>6} {'greedy tok/s':>13} {'dflash tok/s':>13} {'speedup':>8} {'tau':>6} "
             f"{'ttft ms':>8} {'identical':>9}"]
    for index, row in enumerate(report["prompts"], 1):
        greedy, dflash = row["greedy"], row["dflash"]
        lines.append(f"{index:<7} {dflash['tokens']:>6} {greedy['tokens_per_second']:>13.1f} "
                     f"{dflash['tokens_per_second']:>13.1f} {row['speedup']:>7.2f}x {dflash['tau']:>6.2f} "
                     f"{1000 * row['dflash']['ttft_s']:>8.1f} {str(row['identical_to_greedy']):>9}")
    g, d = agg["greedy"], agg["dflash"]
    lines += [
        f"{'all':<7} {d['tokens']:>6} {g['tokens_per_second']:>13.1f} {d['tokens_per_second']:>13.1f} "
        f"{agg['speedup']:>7.2f}x {agg['tau']:>6.2f} {d['ttft_ms_median']:>8.1f} "
        f"{str(agg['all_identical_to_greedy']):>9}", "",
        f"end to end (prefill included): greedy {g['end_to_end_tokens_per_second']:.1f} tok/s, DFlash "
        f"{d['end_to_end_tokens_per_second']:.1f} tok/s, speedup {agg['end_to_end_speedup']:.2f}x",
        f"loop overhead (decode time outside backend calls): greedy {100 * g['loop_overhead']:.1f} %, "
        f"DFlash {100 * d['loop_overhead']:.1f} %",
        f"acceptance histogram 1..{block}: {agg['acceptance_histogram']}",
        "tokens equal to greedy's (share of prompts / of tokens before the first difference): " + ", ".join(
            f"{mode} {a['prompts']:.0%} / {a['tokens']:.1%}" for mode, a in agg["agreement"].items()),
    ]
    if "greedy_unpadded" in agg:
        lines.append(f"greedy without the batch-invariance padding (row multiple {report.get('row_multiple')}): "
                     f"{agg['greedy_unpadded']['tokens_per_second']:.1f} tok/s; DFlash against it "
                     f"{agg['speedup_vs_unpadded']:.2f}x")
    if "greedy_unguessed" in agg:
        guessed = sum(r["greedy"]["guessed"] for r in report["prompts"])
        right = sum(r["greedy"]["guessed_right"] for r in report["prompts"])
        lines.append(f"greedy with a plain padding row (no lookup guess in it): "
                     f"{agg['greedy_unguessed']['tokens_per_second']:.1f} tok/s; the guess buys "
                     f"{g['tokens_per_second'] / agg['greedy_unguessed']['tokens_per_second']:.2f}x "
                     f"({right} of {guessed} guesses right)")
    if "full" in agg:
        drafted = sum(r["dflash"]["drafted_steps"] for r in report["prompts"])
        steps = sum(len(r["dflash"]["acceptance_lengths"]) for r in report["prompts"])
        costs = report["costs"]
        lines += [f"full blocks: DFlash {agg['full']['tokens_per_second']:.1f} tok/s, speedup "
                  f"{agg['full_speedup']:.2f}x, tau {agg['full_tau']:.2f}; {report['verify']}: drafted in {drafted} of "
                  f"{steps} steps, speedup {agg['speedup']:.2f}x",
                  f"cost curve ({costs['source'] or 'given'}, context {costs['context']}): t(T) ms "
                  + " ".join(f"{t:.3g}" for t in costs["verify_ms"]) + f", draft {costs['draft_ms']:.3g} ms"]
    curve = report["curve"]
    if "skipped" in curve:
        lines.append(f"verify-cost curve skipped: {curve['skipped']}")
    else:
        lines += ["", "target step ms by new tokens T (rows: context); draft step ms; implied speedup at tau "
                  f"{agg['tau']:.2f}; break-even tau",
                  f"{'context':>8} " + " ".join(f"{'T=' + str(t):>7}" for t in curve["verify_lengths"])
                  + f" {'draft':>7} {'implied':>8} {'break-even':>10}"]
        for context, times in curve["target_ms"].items():
            implied = report["implied"].get(context, {})
            lines.append(f"{context:>8} " + " ".join(f"{t:>7.2f}" for t in times)
                         + f" {curve['draft_ms'][context]:>7.2f} {implied.get('implied_speedup', 0):>7.2f}x "
                           f"{implied.get('break_even_tau', 0):>10.2f}")
    if report.get("depths"):
        lines += ["", *format_depths(report)]
    if report.get("peers"):
        from dflash_onnx.peers import format_peers

        lines += ["", format_peers(report["peers"])]
    if report.get("loaded"):
        lines += ["", _format_loaded(report)]
    return "\n".join(lines)


def _format_loaded(report: dict) -> str:
    loaded = report["loaded"]
    lines = [f"quiet vs {loaded['load']} busy process(es) beside the runs (tok/s, decode only)",
             f"{'':<48} {'quiet':>9} {'loaded':>9} {'change':>8}"]
    for row in quiet_and_loaded(report):
        lines.append(f"{row['name']:<48} {row['quiet']:>9.1f} {row['loaded']:>9.1f} {100 * row['change']:>7.0f}%")
    ratios = loaded.get("peers", {}).get("ratios", {})
    quiet_ratios = report.get("peers", {}).get("ratios", {})
    lines += [f"{name:<48} {quiet_ratios.get(name, 0):>8.2f}x {value:>8.2f}x" for name, value in ratios.items()]
    if not loaded["aggregate"]["all_identical_to_greedy"]:
        lines.append("warning: under load a DFlash run's tokens differ from greedy")
    return "\n".join(lines)


OUR_RUNS = {"greedy": "ours greedy", "greedy_unpadded": "ours greedy, one row per step (no batch-invariance padding)",
            "greedy_unguessed": "ours greedy, padding row without the lookup guess",
            "full": "ours DFlash, full blocks"}


DEPTH_MODES = (("one_row", "one-row greedy"), ("greedy", "greedy"), ("dflash", "DFlash"))


def _depth_rate(depth: dict, mode: str) -> float:
    agg = depth["aggregate"]
    return agg[depth["one_row_greedy"] if mode == "one_row" else mode]["tokens_per_second"]


def format_depths(report: dict) -> list[str]:
    """Per prompt length: time to first token, the prefill rate, and decoding at that depth per mode."""
    lines = ["by prompt length (decode tok/s at that depth; ttft and prefill of one-row greedy's prompt)",
             f"{'prompt':>7} {'ttft ms':>9} {'prefill tok/s':>14} " + " ".join(f"{name:>15}" for _, name in DEPTH_MODES)
             + f" {'tau':>6} {'DFlash/one-row':>15} {'identical':>9}"]
    for depth in report["depths"]:
        agg = depth["aggregate"]
        rates = " ".join(f"{_depth_rate(depth, mode):>15.1f}" for mode, _ in DEPTH_MODES)
        against = _depth_rate(depth, "dflash") / _depth_rate(depth, "one_row")
        prefill = depth["prefill_tokens_per_second"]
        lines.append(f"{depth['prompt_tokens']:>7} {depth['ttft_ms']:>9.1f} {prefill:>14.1f} {rates} "
                     f"{agg['tau']:>6.2f} {against:>14.2f}x {str(agg['all_identical_to_greedy']):>9}")
    return lines


def depth_figures(report: dict, command: list[str]) -> dict:
    """The by-prompt-length table as a figures record (docs/figures/), with each peer's decode rate at the same
    depth where peers ran."""
    peer_names = [row["name"].split(" (")[0] for row in report["depths"][0].get("peers", {}).get("rows", [])
                  if "unavailable" not in row]
    header = ["prompt tokens", "ttft ms", "prefill tok/s", *(name for _, name in DEPTH_MODES), "tau",
              "DFlash / one-row greedy", *peer_names]
    rows = []
    for depth in report["depths"]:
        peers = {row["name"].split(" (")[0]: row for row in depth.get("peers", {}).get("rows", [])}
        rows.append([depth["prompt_tokens"], f"{depth['ttft_ms']:.1f}", f"{depth['prefill_tokens_per_second']:.1f}",
                     *(f"{_depth_rate(depth, mode):.1f}" for mode, _ in DEPTH_MODES),
                     f"{depth['aggregate']['tau']:.2f}",
                     f"{_depth_rate(depth, 'dflash') / _depth_rate(depth, 'one_row'):.2f}x",
                     *(f"{peers[name]['tokens_per_second']:.1f}" for name in peer_names)])
    identical = all(depth["aggregate"]["all_identical_to_greedy"] for depth in report["depths"])
    caption = (f"{len(report['depths'][0]['prompts'])} prompts of held-out code per length x "
               f"{report['max_new_tokens']} new tokens, block {report['block_size']}, medians of {report['repeats']} "
               f"runs, on {report['backend']}; DFlash tokens identical to greedy: {'yes' if identical else 'NO'}.")
    return figures_record(header, rows, caption, command)


def markdown_report(report: dict, command: list[str]) -> str:
    """The summary as docs/ prints it: tok/s of each run kind (ours and every peer), quiet and beside the busy
    processes of --load, tau and whether the tokens were ours, then the line naming `command`, date and machine."""
    return render(bench_figures(report, command))


def bench_figures(report: dict, command: list[str]) -> dict:
    """`markdown_report`'s table as a figures record, which `--json` keeps in the report: a docs table regenerated
    from the file (docs/figures/) rather than retyped."""
    agg, loaded = report["aggregate"], report.get("loaded")
    names = {**OUR_RUNS, "dflash": f"ours DFlash, verify {report.get('verify', 'full')}"}
    quiet = {m: agg[m]["tokens_per_second"] for m in names if m in agg}
    busy = {m: loaded["aggregate"][m]["tokens_per_second"] for m in quiet} if loaded else {}
    tau = {"dflash": agg["tau"], "full": agg.get("full_tau")}
    rows = [[names[m], f"{quiet[m]:.1f}", *([f"{busy[m]:.1f}"] if loaded else []),
             f"{quiet[m] / quiet['greedy']:.2f}x", f"{tau[m]:.2f}" if tau.get(m) else "", "-"] for m in quiet]
    loaded_peers = {r["name"]: r for r in (loaded or {}).get("peers", {}).get("rows", [])}
    for row in report.get("peers", {}).get("rows", []):
        if "unavailable" in row:
            rows.append([f"{row['name']}: unavailable, {row['unavailable']}", "-", *(["-"] if loaded else []), "-",
                         "", "-"])
            continue
        rows.append([row["name"], f"{row['tokens_per_second']:.1f}",
                     *([f"{loaded_peers[row['name']]['tokens_per_second']:.1f}"] if loaded else []),
                     f"{row['tokens_per_second'] / quiet['greedy']:.2f}x",
                     f"{row['tau']:.2f}" if row["tau"] is not None else "",
                     {None: "-", True: "yes", False: "no"}[row["identical_to_ours"]]])
    header = ["run", "tok/s quiet", *([f"tok/s, {loaded['load']} busy"] if loaded else []), "vs our greedy", "tau",
              "our tokens"]
    identical = agg["all_identical_to_greedy"] and (not loaded or loaded["aggregate"]["all_identical_to_greedy"])
    caption = (f"{len(report['prompts'])} prompts x {report['max_new_tokens']} new tokens, block "
               f"{report['block_size']}, medians of {report['repeats']} runs, on {report['backend']}; DFlash tokens "
               f"identical to greedy: {'yes' if identical else 'NO'}.")
    return figures_record(header, rows, caption, command)

