"""The Apple-silicon bench (issue 18), one script for a Mac: export, lower for MLX and CoreML, bench, one table.

Runs on macOS 15+ with Apple silicon (`pip install -e ".[export,mlx-bench,coreml]"`): the pair is your
checkpoints (`--target`, `--draft`: e.g. Qwen/Qwen3-4B and z-lab/Qwen3-4B-DFlash-b16, downloaded beforehand;
nothing is fetched here) or, without them, the Qwen3-4B shape with random weights (speeds are real, tokens
are not language). Stages, each skipped when its output exists:

1. export in float16;
2. `lower --target mlx --bits 4` and `lower --target coreml --bits 4` (one multifunction package, checked
   in numpy against the converted modules at lowering);
3. `bench` quiet and beside one busy process (`--load 1`): MLX with `--peers mlx-lm` (mlx-lm's own model at
   the same 4 bits), CoreML once per compute-unit choice (all, cpu_and_ne, cpu_and_gpu);
4. a table in the seed's terms: greedy and DFlash tokens/s, DFlash / greedy, tau, and ours / mlx-lm.

Each stage's log and each bench's JSON go to --work; a failed stage prints its log's tail.

    python benchmarks/apple_bench.py --work ~/dflash-apple [--target DIR --draft DIR] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

from dflash_onnx.figures import markdown_table, provenance

CLI = [sys.executable, "-m", "dflash_onnx.cli"]
UNITS = ("all", "cpu_and_ne", "cpu_and_gpu")


def stage(name: str, command: list[str], work: Path, done: Path) -> None:
    """Run one stage unless `done` exists; its output in work/<name>.log; stop with its tail on failure."""
    if done.exists():
        print(f"[{name}] done before: {done}", flush=True)
        return
    print(f"[{name}] {' '.join(map(str, command))}", flush=True)
    log = work / f"{name}.log"
    with open(log, "w") as out:
        code = subprocess.call([str(c) for c in command], stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        print(log.read_text()[-3000:], file=sys.stderr)
        raise SystemExit(f"[{name}] failed (exit {code}); log: {log}")


HEADER = ["run", "load", "greedy tok/s", "DFlash tok/s", "DFlash / greedy", "tau"]


def _row(label: str, report: dict) -> list[list[str]]:
    """The table's rows for one bench report: tokens/s, DFlash / greedy and tau, then the peers' ratios, quiet and
    beside the busy process."""
    rows = []
    for kind, run in (("quiet", report), ("1 busy", report.get("loaded"))):
        if not run:
            continue
        aggregate = run["aggregate"]
        rows.append([label, kind, f"{aggregate['greedy']['tokens_per_second']:.1f}",
                     f"{aggregate['dflash']['tokens_per_second']:.1f}", f"{aggregate['speedup']:.2f}x",
                     f"{aggregate['tau']:.2f}"])
        for name, ratio in (run.get("peers") or {}).get("ratios", {}).items():
            rows.append([label, f"{name} ({kind})", "", "", f"{ratio:.2f}x", ""])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--target", type=Path, help="target checkpoint (HF layout); default: the Qwen3-4B shape")
    parser.add_argument("--draft", type=Path, help="its DFlash draft checkpoint")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=4)
    args = parser.parse_args(argv)
    if platform.system() != "Darwin" or platform.machine() != "arm64":
        raise SystemExit("this bench is for Apple silicon (macOS 15+): MLX's Metal backend and CoreML run there")
    if bool(args.target) != bool(args.draft):
        raise SystemExit("give --target and --draft together, or neither (the Qwen3-4B shape, random weights)")
    work = args.work.expanduser()
    work.mkdir(parents=True, exist_ok=True)
    target, draft = args.target, args.draft
    if target is None:
        pair = work / "pair"
        stage("pair", [sys.executable, "-m", "dflash_onnx.exporter.tiny", "--preset", "qwen3-4b-shaped", "--out", pair],
              work, pair / "target" / "config.json")
        target, draft = pair / "target", pair / "draft"
    onnx, mlx, coreml = work / "onnx", work / "mlx4", work / "coreml4"
    stage("export", [*CLI, "export", "--target", target, "--draft", draft, "--dtype", "float16", "--out", onnx],
          work, onnx / "dflash.json")
    stage("lower-mlx", [*CLI, "lower", onnx, "--target", "mlx", "--bits", "4", "--out", mlx], work,
          mlx / "dflash.json")
    stage("lower-coreml", [*CLI, "lower", onnx, "--target", "coreml", "--bits", "4", "--out", coreml], work,
          coreml / "dflash.json")
    common = ["--max-new-tokens", str(args.max_new_tokens), "--num-prompts", str(args.num_prompts), "--load", "1",
              "--quiet"]
    runs = {"MLX 4-bit": (mlx, ["--peers", "mlx-lm"])}
    runs.update({f"CoreML int4, {units}": (coreml, ["--compute-units", units]) for units in UNITS})
    rows = []
    for label, (directory, extra) in runs.items():
        report = work / f"bench-{label.replace(' ', '_').replace(',', '')}.json"
        stage(f"bench-{report.stem}", [*CLI, "bench", directory, *common, *extra, "--json", report], work, report)
        rows += _row(label, json.loads(report.read_text()))
    text = markdown_table(HEADER, rows) + "\n\n" + provenance(libraries=("mlx", "mlx-lm", "coremltools"))
    (work / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
