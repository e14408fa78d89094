"""One call for N requests side by side against a request's own call, the target's and the draft's: ms per call
and per request. Target: a step of `--step-rows` rows per request (2: a greedy step padded to the row multiple)
after `--context` tokens, over the batch store's slots; draft (where the lowering shares it,
targets/ort/draft_batch.py): `--rows` new context rows per request after `--context` cached ones (what a DFlash
step after a verify of that many committed tokens asks). On a ragged ORT lowering (`lower --target ort
--kv-attention ragged`).

    python benchmarks/batch_calls.py LOWERED_DIR [--requests 1,2,4,8] [--context 200] [--rows 4] [--step-rows 2]
        [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.targets import open_batch, open_decoder

NAMES = ["draft_ids", "draft_confidence"]


def _median_ms(call: Callable[[], object], repeats: int) -> float:
    call()  # its shapes' first run
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def target_steps(decoder, store, counts: list[int], args: argparse.Namespace) -> None:
    """A step of args.step_rows rows per request after args.context tokens: the single-request session's call,
    then the batch store's over 1..N slots."""
    rows, start = args.step_rows, args.context

    def feeds(count: int) -> dict[str, np.ndarray]:
        lengths = np.full(count, start + rows - 1, np.int32)
        return {"input_ids": np.full((count, rows), 5, np.int64),
                "position_ids": np.tile(np.arange(start, start + rows, dtype=np.int64), (count, 1)),
                "seqlens_k": lengths, "total_sequence_length": np.array(start + rows, np.int32)}

    names = ["greedy_ids", "target_hidden"]
    decoder.target.run({**feeds(1), "input_ids": np.full((1, start + rows), 5, np.int64),
                        "position_ids": np.arange(start + rows, dtype=np.int64)[None]}, names)  # its context
    single = _median_ms(lambda: decoder.target.run(feeds(1), names), args.repeats)
    print(f"target, each request a {rows}-row step after {start} tokens:")
    print(f"  a request's own call: {single:.2f} ms")
    for count in counts:
        store.active = count
        shared = _median_ms(lambda: store.run_slots(0, feeds(count), names), args.repeats)  # noqa: B023
        print(f"  one call for {count}: {shared:.2f} ms, {shared / count:.2f} ms a request "
              f"({single * count / shared:.2f}x their own calls)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--requests", default="1,2,4,8")
    parser.add_argument("--context", type=int, default=200, help="context rows each request's draft holds")
    parser.add_argument("--rows", type=int, default=4, help="new context rows per request per call")
    parser.add_argument("--step-rows", type=int, default=2, help="rows per request of a target step")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    counts = [int(n) for n in args.requests.split(",")]
    decoder = open_decoder(args.directory)
    parts = open_batch(decoder, max(counts))
    print(f"{args.directory}: medians of {args.repeats}")
    target_steps(decoder, parts.store, counts, args)
    if parts.drafts is None:
        raise DFlashError(f"{args.directory}: its requests do not share draft calls (a ragged CPU lowering whose "
                          "draft takes the key mask does)")
    manifest, rng = decoder.manifest, np.random.default_rng(0)
    block, features = manifest.block_size, manifest.num_taps * manifest.target_hidden_size

    def feeds(past: int, rows: int) -> dict[str, np.ndarray]:
        return {"input_ids": np.full((1, block), manifest.mask_token_id, np.int64),
                "target_hidden": rng.standard_normal((1, rows, features)).astype(manifest.numpy_dtype),
                "position_ids": np.arange(past, past + rows + block, dtype=np.int64)[None]}

    alone = decoder.draft.fork()
    alone.run(feeds(0, args.context), NAMES)
    single = _median_ms(lambda: alone.run(feeds(args.context, args.rows), NAMES), args.repeats)
    print(f"draft, each request {args.rows} new context rows after {args.context}:")
    print(f"  a request's own draft call: {single:.2f} ms")
    for count in counts:
        parts.drafts.run_slots({slot: (feeds(0, args.context), NAMES) for slot in range(count)}, count)
        calls = {slot: (feeds(args.context, args.rows), NAMES) for slot in range(count)}
        shared = _median_ms(lambda: parts.drafts.run_slots(calls, count), args.repeats)  # noqa: B023
        print(f"  one call for {count}: {shared:.2f} ms, {shared / count:.2f} ms a request "
              f"({single * count / shared:.2f}x their own calls)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DFlashError as exc:
        sys.exit(f"error: {exc}")
