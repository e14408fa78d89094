"""What each ONNX Runtime session setting buys for greedy decoding, quiet and with busy processes beside it.

Opens one ORT lowering once per variant (the recorded options, then one setting changed), runs greedy decoding
of the same prompt on each in rotation, and onnxruntime-genai's greedy on the same target at the same precision
beside them; then the same with `--load` busy processes. Prints tok/s per variant, quiet and loaded.

    python benchmarks/load_knobs.py ORT_DIR --load 1 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from dflash_onnx.figures import markdown_table, provenance
from dflash_onnx.runtime.busy import busy_processes
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets import open_decoder

VARIANTS = {
    "recorded options": {},
    "no spinning": {"allow_spinning": False},
    "1 thread": {"intra_op_threads": 1},
    "2 threads, named (no affinity)": {"intra_op_threads": 2},
    "2 threads, named, spin within calls": {"intra_op_threads": 2,
                                            "session_config": {"session.force_spinning_stop": "1"}},
    "dynamic blocks (base 4)": {"session_config": {"session.dynamic_block_base": "4"}},
    "no spinning + dynamic blocks": {"allow_spinning": False, "session_config": {"session.dynamic_block_base": "4"}},
    "no spinning + dynamic blocks (base 1)": {"allow_spinning": False,
                                              "session_config": {"session.dynamic_block_base": "1"}},
    "spin within calls only": {"session_config": {"session.force_spinning_stop": "1"}},
    "spin within calls + dynamic blocks": {"session_config": {"session.force_spinning_stop": "1",
                                                             "session.dynamic_block_base": "4"}},
}


def ours(directory: Path, settings: dict):
    decoder = open_decoder(directory, batch_invariant=False, **settings)  # one row per step, as the peer runs

    def once(ids: list[int], new: int) -> tuple[list[int], float]:
        result = decoder.generate(ids, new, "greedy", stop_token_ids=[])
        return result.tokens, result.decode_s
    return once


def genai(directory: Path):
    import onnxruntime_genai as og

    from dflash_onnx.peers import genai_block_size, genai_build, genai_model_dir

    manifest = load_manifest(directory)
    target, _ = manifest.checkpoints(None, None)
    model = og.Model(str(genai_model_dir(Path(target), *genai_build(manifest), genai_block_size(manifest))))

    def once(ids: list[int], new: int) -> tuple[list[int], float]:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + new, min_length=len(ids) + new)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        generator.generate_next_token()
        tokens, started = [int(generator.get_next_tokens()[0])], time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        return tokens, time.perf_counter() - started
    return once


def measure(runners: dict, ids: list[int], new: int, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in runners}
    for index in range(rounds + 1):  # the first round warms up
        names = list(runners)[index % len(runners):] + list(runners)[: index % len(runners)]
        for name in names:
            tokens, seconds = runners[name](ids, new)
            if index:
                times[name].append((len(tokens) - 1) / seconds)
    return {name: float(np.median(values)) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--load", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--variants", help="names separated by ; (default: all)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    chosen = args.variants.split(";") if args.variants else list(VARIANTS)
    runners = {name: ours(args.directory, VARIANTS[name]) for name in chosen}
    runners["onnxruntime-genai"] = genai(args.directory)
    manifest = load_manifest(args.directory)
    ids = np.random.default_rng(0).integers(2, manifest.vocab_size - 1, args.prompt_tokens).tolist()
    quiet = measure(runners, ids, args.new_tokens, args.rounds)
    with busy_processes(args.load):
        loaded = measure(runners, ids, args.new_tokens, args.rounds)
    genai_quiet, genai_loaded = quiet["onnxruntime-genai"], loaded["onnxruntime-genai"]
    rows = [[name, f"{quiet[name]:.1f}", f"{loaded[name]:.1f}", f"{100 * (loaded[name] / quiet[name] - 1):.0f} %",
             f"{quiet[name] / genai_quiet:.2f}x / {loaded[name] / genai_loaded:.2f}x"] for name in runners]
    print(markdown_table(["greedy, one variant each", "quiet tok/s", f"{args.load} busy", "change",
                          "vs onnxruntime-genai quiet / busy"], rows))
    print(f"\n{provenance(libraries=('onnxruntime', 'onnxruntime-genai'))}")
    if args.json:
        args.json.write_text(json.dumps({"quiet": quiet, "loaded": loaded, "load": args.load}, indent=1))


if __name__ == "__main__":
    main()
