"""Requests decoded side by side in one process against the same requests decoded one at a time: the share of
outputs identical, and total tokens/s both ways. The engine `serve` runs (serving/host.EngineSettings), without
HTTP, so it runs where FastAPI is not installed (a leased GPU machine) and on any provider the lowering was made
for (CPU or CUDA, `lower --target ort --kv-attention ragged`).

    python benchmarks/batch_check.py LOWERED_DIR [--batch 4] [--requests 8] [--max-new-tokens 64]
        [--shared-draft on,off]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np

from runtime.manifest import load_manifest
from serving.engine import GenerationRequest
from serving.host import EngineSettings


def decode_all(settings: EngineSettings, prompts: list[list[int]], max_new_tokens: int) -> tuple[list, float]:
    """Each prompt's (text, tokens, finish) from an engine of `settings`, all submitted at once, and the seconds
    from the first submission to the last event."""
    engine = settings.open()
    try:
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
    finally:
        engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--batch", type=int, default=4, help="requests decoded side by side")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared-draft", default="on", help="side by side with the drafts joined into one call a "
                        "step (on), each request's own (off), or both in one run (on,off)")
    args = parser.parse_args()
    modes = args.shared_draft.split(",")
    if not modes or set(modes) - {"on", "off"}:
        parser.error(f"--shared-draft takes on, off or on,off, got {args.shared_draft!r}")
    vocab = load_manifest(args.directory).vocab_size
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, vocab, int(rng.integers(4, 48))).tolist() for _ in range(args.requests)]
    alone, alone_s = decode_all(EngineSettings(args.directory, max_queue=args.requests), prompts, args.max_new_tokens)
    tokens = sum(r[1] for r in alone)
    print(f"{args.requests} requests, {tokens} tokens: one at a time {tokens / alone_s:.1f} tok/s")
    failed = False
    for mode in modes:
        settings = EngineSettings(args.directory, max_batch=args.batch, max_queue=args.requests,
                                  shared_draft=mode == "on")
        batched, batched_s = decode_all(settings, prompts, args.max_new_tokens)
        errors = [r for r in alone + batched if r[2] not in ("stop", "length")]
        same = sum(a[:2] == b[:2] for a, b in zip(alone, batched))
        print(f"  {args.batch} side by side, shared draft {mode}: {sum(r[1] for r in batched) / batched_s:.1f} tok/s "
              f"({alone_s / batched_s:.2f}x one at a time); identical outputs {same}/{args.requests}; errors "
              f"{len(errors)}")
        for error in errors[:3]:
            print(f"  error: {error[2]}")
        failed = failed or same != args.requests or bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
