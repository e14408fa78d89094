"""Requests decoded side by side in one process against the same requests decoded one at a time: the share of
outputs identical, and total tokens/s each way. The engine `serve` runs (dflash_onnx/serving/host.EngineSettings),
without
HTTP, so it runs where FastAPI is not installed (a leased GPU machine) and on any provider the lowering was made
for (CPU or CUDA, `lower --target ort --kv-attention ragged`).

Every engine is opened once and warmed by a first round (its sessions' first calls and page faults are not
timed); then the rounds alternate between the engines, `--rounds` times, and each figure is the median. Engines
opened anew per round made whichever ran first after another engine closed look slower (measured: a 0.6B
shared-draft engine at 72 tok/s cold against 97 warm).

    python benchmarks/batch_check.py LOWERED_DIR [--batch 4] [--requests 8] [--max-new-tokens 64]
        [--shared-draft on|off|on,off] [--greedy] [--rounds 3] [--load 0|1]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.serving.engine import Engine, GenerationRequest
from dflash_onnx.serving.host import EngineSettings


def decode_all(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[list, float]:
    """Each prompt's (text, tokens, finish) from `engine`, all submitted at once, and the seconds from the first
    submission to the last event."""
    started = time.perf_counter()
    submissions = [engine.submit(GenerationRequest(prompt, max_new_tokens)) for prompt in prompts]
    results: list = [None] * len(prompts)

    def collect(index: int) -> None:
        text, last = [], None
        for last in submissions[index]:
            text.append(last.text)
        results[index] = ("".join(text), last.completion_tokens, last.finish or last.error)

    threads = [threading.Thread(target=collect, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--batch", type=int, default=4, help="requests decoded side by side")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared-draft", default="on", help="side by side with the greedy requests' drafts joined "
                        "into one call a step (on), each request's own (off), or both (on,off)")
    parser.add_argument("--greedy", action="store_true", help="also side by side decoding greedily (--verify 0)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine, alternating")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the engines")
    args = parser.parse_args()
    shared = args.shared_draft.split(",")
    if not shared or set(shared) - {"on", "off"} or args.rounds < 1:
        parser.error("--shared-draft takes on, off or on,off; --rounds at least 1")
    vocab = load_manifest(args.directory).vocab_size
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, vocab, int(rng.integers(4, 48))).tolist() for _ in range(args.requests)]
    settings = {"one at a time": EngineSettings(args.directory, max_queue=args.requests)}
    for mode in shared:
        settings[f"{args.batch} side by side, shared draft {mode}"] = EngineSettings(
            args.directory, max_batch=args.batch, max_queue=args.requests, shared_draft=mode == "on")
    if args.greedy:
        settings[f"{args.batch} side by side, greedy (--verify 0)"] = EngineSettings(
            args.directory, max_batch=args.batch, max_queue=args.requests, verify="0")
    engines = {name: value.open() for name, value in settings.items()}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list] = {}
    try:
        for name, engine in engines.items():
            outputs[name], _ = decode_all(engine, prompts, args.max_new_tokens)  # warm-up, and the outputs
        for _ in range(args.rounds):
            for name, engine in engines.items():
                results, seconds = decode_all(engine, prompts, args.max_new_tokens)
                rates[name].append(sum(r[1] for r in results) / seconds)
    finally:
        for process in busy:
            process.kill()
        for engine in engines.values():
            engine.close()
    alone = outputs["one at a time"]
    print(f"{args.requests} requests of up to {args.max_new_tokens} tokens, {args.rounds} rounds each, medians"
          f"{f', beside {args.load} busy process(es)' if args.load else ''}:")
    failed = False
    base = statistics.median(rates["one at a time"])
    for name, engine in engines.items():
        errors = [r for r in outputs[name] if r[2] not in ("stop", "length")]
        same = sum(a[:2] == b[:2] for a, b in zip(alone, outputs[name]))
        rate = statistics.median(rates[name])
        stats = engine.batcher.stats if engine.batcher else None
        drafts = f"; {stats.drafted_requests} request drafts in {stats.draft_calls} draft calls" if stats and \
            stats.draft_calls else ""
        print(f"  {name}: {rate:.1f} tok/s ({rate / base:.2f}x one at a time); identical outputs {same}/"
              f"{args.requests}; errors {len(errors)}{drafts}")
        for error in errors[:3]:
            print(f"    error: {error[2]}")
        failed = failed or same != args.requests or bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
