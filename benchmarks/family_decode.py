"""A target family against a dense model of the same shape, side by side on ORT (issue 32's yardsticks).

`--family moe`: a mixture-of-experts target (Qwen3-MoE) with `--experts` experts of `--moe-intermediate` each,
`--per-token` of them routed to per token, against a dense Qwen3 with one MLP of per_token x moe_intermediate,
so a token reads as many MLP weights in both (the goal: MoE decode per token within 1.3x of the dense model's).
`--family gemma4-moe`: Gemma 4's MoE layers (a dense MLP of `--intermediate` beside `--experts` routed experts,
`--per-token` chosen by Gemma 4's own router; sliding and global layers of their own head sizes) against Gemma 4
with the dense MLP widened by per_token x moe_intermediate and no experts: the same weights read per token.
`--family hybrid`: a Gated-DeltaNet hybrid (Qwen3.5: three linear-attention layers to one full) against the same
Qwen3.5 shape with every layer full attention: what the linear layers' recurrent state costs a decode step and a
verify step (each token's update, and the commit's pending rows), against K/V attention at `--context` tokens.

Both are random-weight pairs from dflash_onnx/exporter/tiny.py; each is built, exported, quantized (`--precision int4`:
`optimize --passes int4`) and lowered for ORT; then `bench` runs on both directories in interleaved rounds
(greedy and DFlash tokens/s, the target's step for 1 and block tokens), quiet and with `--load 1`. Prints the
table in the docs' format.

    python benchmarks/family_decode.py --family moe|gemma4-moe|hybrid --work /tmp/familybench [--precision int4|float32]
        [--rounds 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from dflash_onnx.exporter.tiny import TinySpec, build_pair
from dflash_onnx.figures import markdown_table, provenance

CLI = [sys.executable, "-m", "dflash_onnx.cli"]


def specs(args: argparse.Namespace) -> dict[str, TinySpec]:
    """The family's target and its dense counterpart, by the names the table prints."""
    if args.family == "hybrid":
        key_heads, value_heads = args.linear_heads
        shape = TinySpec(model_type="qwen3_5_text", vocab_size=args.vocab, hidden_size=args.hidden, num_heads=16,
                         num_kv_heads=4, head_dim=128, target_layers=args.layers, draft_layers=1,
                         target_layer_ids=[1, args.layers - 2], block_size=16, agree=True, tie_embeddings=False,
                         damp_layers=0.002, max_positions=4096, linear_heads=(key_heads, value_heads),
                         linear_head_dim=args.linear_head_dim)
        return {"hybrid": replace(shape, full_attention_interval=4, multimodal="ort-genai" in args.peers),
                "dense": replace(shape, full_attention_interval=1)}
    if args.family == "gemma4-moe":
        shape = TinySpec(model_type="gemma4_text", vocab_size=args.vocab, hidden_size=args.hidden, num_heads=8,
                         num_kv_heads=4, head_dim=128, global_head_dim=256, global_kv_heads=2, k_eq_v=True,
                         target_layers=args.layers, draft_layers=1, target_layer_ids=[1, args.layers - 2],
                         block_size=16, agree=True, tie_embeddings=False, damp_layers=0.002, max_positions=4096,
                         target_sliding_window=128, final_logit_softcapping=30.0, intermediate_size=args.intermediate)
        return {"moe": replace(shape, num_experts=args.experts, experts_per_token=args.per_token,
                               moe_intermediate_size=args.moe_intermediate),
                "dense": replace(shape, intermediate_size=args.intermediate + args.per_token * args.moe_intermediate)}
    shape = TinySpec(vocab_size=args.vocab, hidden_size=args.hidden, num_heads=16, num_kv_heads=8, head_dim=128,
                     target_layers=args.layers, draft_layers=1, target_layer_ids=[1, args.layers - 2],
                     block_size=16, agree=True, tie_embeddings=False, damp_layers=0.002, max_positions=4096)
    return {"moe": replace(shape, model_type="qwen3_moe", num_experts=args.experts, experts_per_token=args.per_token,
                           moe_intermediate_size=args.moe_intermediate),
            "dense": replace(shape, intermediate_size=args.per_token * args.moe_intermediate)}


def run(command: list, log: Path) -> None:
    with open(log, "a") as out:
        code = subprocess.call([*map(str, command)], stdout=out, stderr=subprocess.STDOUT)
    if code:
        sys.exit(f"{' '.join(map(str, command))} failed (exit {code}); see {log}")


def prepare(name: str, spec: TinySpec, work: Path, precision: str) -> Path:
    """Build, export, (quantize,) lower: the lowered directory (reused when it is there)."""
    root = work / name
    lowered = root / f"ort_{precision}"
    if (lowered / "dflash.json").is_file():
        return lowered
    log = root / "prepare.log"
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "target" / "config.json").is_file():
        print(f"{name}: building the pair", file=sys.stderr)
        build_pair(spec, root)
    if not (root / "export" / "dflash.json").is_file():
        print(f"{name}: exporting", file=sys.stderr)
        run([*CLI, "export", "--target", root / "target", "--draft", root / "draft", "--out", root / "export",
             "--quiet"], log)
    source = root / "export"
    if precision == "int4":
        source = root / "int4"
        if not (source / "dflash.json").is_file():
            print(f"{name}: int4", file=sys.stderr)
            run([*CLI, "optimize", root / "export", "--passes", "int4", "--out", source], log)
    print(f"{name}: lowering for ORT", file=sys.stderr)
    run([*CLI, "lower", source, "--target", "ort", "--out", lowered], log)
    return lowered


def bench(directory: Path, load: int, context: int, out: Path, peers: str = "") -> dict:
    run([*CLI, "bench", directory, "--num-prompts", "2", "--max-new-tokens", "64", "--repeats", "3", "--contexts",
         str(context), "--quiet", "--load", str(load), "--json", out, *(["--peers", peers] if peers else [])],
        out.with_suffix(".log"))
    return json.loads(out.read_text())


def figures(report: dict, loaded: bool, context: int) -> dict[str, float]:
    """tokens/s of greedy and DFlash; quiet: also the target's step (ms) for 1 and for block new tokens."""
    aggregate = report["loaded"]["aggregate"] if loaded else report["aggregate"]
    found = {"greedy": aggregate["greedy"]["tokens_per_second"], "dflash": aggregate["dflash"]["tokens_per_second"]}
    if not loaded:
        steps = dict(zip(report["curve"]["verify_lengths"], report["curve"]["target_ms"][str(context)]))
        found.update(step_1=steps[1], step_block=steps[report["block_size"]])
    return found


def peer_rows(reports: list[dict], loaded: bool) -> list[list[str]]:
    """Each peer's tokens/s (median over rounds), whether its tokens were ours, and our greedy (DFlash for a
    speculative peer) over it; quiet, then loaded."""
    rows = []
    for kind in ("quiet", "loaded") if loaded else ("quiet",):
        runs = [(r["loaded"] if kind == "loaded" else r)["peers"] for r in reports]
        for index, first in enumerate(runs[0]["rows"]):
            theirs = statistics.median(run["rows"][index]["tokens_per_second"] for run in runs)
            same = all(run["rows"][index]["identical_to_ours"] for run in runs)
            ours_key = "dflash" if "speculative" in first["name"] else "greedy"
            ours = statistics.median((r["loaded"]["aggregate"] if kind == "loaded" else r["aggregate"])[ours_key]
                                     ["tokens_per_second"] for r in reports)
            rows.append([f"{first['name']}{', loaded' if kind == 'loaded' else ''}", f"{theirs:.1f}",
                         str(same), f"{ours_key} {ours / theirs:.2f}x"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("moe", "gemma4-moe", "hybrid"), default="moe")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--precision", choices=("int4", "float32"), default="int4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--per-token", type=int, default=4)
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=768, help="gemma4-moe: the dense MLP beside the experts")
    parser.add_argument("--linear-heads", type=lambda text: tuple(int(n) for n in text.split(",")), default=(8, 16),
                        help="hybrid: linear-attention key heads,value heads")
    parser.add_argument("--linear-head-dim", type=int, default=128)
    parser.add_argument("--context", type=int, default=256, help="context of the target steps timed")
    parser.add_argument("--load", type=int, default=1, help="also measure beside N busy processes (0: quiet only)")
    parser.add_argument("--peers", default="", help="bench's --peers for the family's target, e.g. ort-genai "
                        "(hybrid: the target is then saved in Qwen3.5's published multimodal layout, which "
                        "onnxruntime-genai's builder takes)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    directories = {name: prepare(name, spec, args.work, args.precision) for name, spec in specs(args).items()}
    results: dict[str, list[dict]] = {name: [] for name in directories}
    for round_ in range(args.rounds):
        for name, directory in directories.items():  # interleaved: both in every round
            print(f"round {round_ + 1}: bench {name}", file=sys.stderr)
            results[name].append(bench(directory, args.load, args.context, args.work / f"bench_{name}_{round_}.json",
                                       args.peers if name != "dense" else ""))
    family = next(name for name in directories if name != "dense")
    rows = []
    speeds = [("greedy", "greedy tok/s"), ("dflash", "DFlash tok/s")]
    steps = [("step_1", f"target step, 1 token (ms, context {args.context})"),
             ("step_block", "target step, 16 tokens (ms)")]
    for loaded in (False, True) if args.load else (False,):
        columns = speeds if loaded else speeds + steps
        medians = {name: {key: statistics.median(figures(r, loaded, args.context)[key] for r in reports)
                          for key, _ in columns} for name, reports in results.items()}
        for key, title in columns:
            ours, dense = medians[family][key], medians["dense"][key]
            ratio = ours / dense if key.startswith("step") else dense / ours  # the family's time over dense time
            rows.append([f"{title}{', loaded' if loaded else ''}", f"{ours:.1f}", f"{dense:.1f}", f"{ratio:.2f}x"])
    if family == "moe":
        header = [f"{args.precision}, {args.family}, {args.experts} experts / {args.per_token} per token vs dense",
                  "MoE", "dense",
                  "MoE time / dense time"]
    else:
        header = [f"{args.precision}, 3 linear : 1 full attention vs all full", "hybrid", "dense",
                  "hybrid time / dense time"]
    print(markdown_table(header, rows))
    print()
    if args.peers:
        print(markdown_table([f"{family} target's peers", "tok/s", "tokens identical to ours", "ours / theirs"],
                             peer_rows(results[family], args.load > 0)))
        print()
    print(provenance())
    if args.json:
        args.json.write_text(json.dumps({"results": results, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
