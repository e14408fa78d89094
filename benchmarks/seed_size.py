"""The seeds' models at their real size (issue 19): every stage of a Qwen3-4B-, LLaMA-3.1-8B-, Qwen3.5-4B- or
gpt-oss-20b-shaped pair (the Gated-DeltaNet hybrid and the MXFP4 mixture of experts, issue 32), with its wall time,
peak memory and output size, in one table.

Stages, each a child process whose peak resident memory comes from `os.wait4` in a small launcher (the same
figure as `/usr/bin/time`'s "Maximum resident set size"):

1. `python -m dflash_onnx.exporter.tiny --preset P` (random weights, the published shapes, bfloat16 shards);
2. `export --dtype float16`, 3. `optimize --passes int4 --pass-option int4.lm_head=true`, 4. `lower --target ort`;
5. `generate` 16 tokens greedy and DFlash from one prompt (twice each): tokens compared, tokens/s reported;
6. with `--ai100`, `--mlx`, `--coreml`: `lower --target ai100 --dry-run`, `lower --target mlx --bits 4`,
   `lower --target coreml --bits 4 --layers-per-part 6` of the float16 export.

The ratio column is the issue's yardstick: peak memory over the size of what an export or optimize writes, and
over the size of the graphs a lowering or a decode reads. A stage the machine cannot hold is refused up front by
the CLI; its one-line reason goes in the table, and the stages that need its output are skipped. `--lean`
deletes the pair once exported and the float16 export once nothing else reads it (the 8B shape's pair and
export take 35 GB of disk together).

    python benchmarks/seed_size.py --preset qwen3-4b-shaped --work /tmp/seed4b [--lean] [--ai100] [--mlx] [--coreml]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dflash_onnx.artifacts.publish import directory_bytes
from dflash_onnx.figures import markdown_table, provenance

CLI = [sys.executable, "-m", "dflash_onnx.cli"]
PROMPT = "11,22,33,44,55,66,77,88"
GIB = 1024**3


# A child starts with its parent's resident size as its high-water mark (Linux keeps it across exec), so each
# stage runs under this small launcher, which waits for it with os.wait4 and reports its peak, as /usr/bin/time
# does: the figure is then the stage's own, give or take the launcher's ~10 MB.
LAUNCHER = ("import os, subprocess, sys; child = subprocess.Popen(sys.argv[2:]); _, status, usage = "
            "os.wait4(child.pid, 0); child.returncode = code = os.waitstatus_to_exitcode(status); "
            "open(sys.argv[1], 'w').write(str(usage.ru_maxrss)); sys.exit(code)")


def run_stage(command: list, log: Path) -> dict:
    """Run `command` with its output in `log`: seconds, peak resident bytes, exit code, last line."""
    started = time.perf_counter()
    peak = log.with_suffix(".peak")
    with open(log, "w") as out:
        code = subprocess.call([sys.executable, "-c", LAUNCHER, str(peak), *map(str, command)], stdout=out,
                               stderr=subprocess.STDOUT)
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    maxrss = int(peak.read_text()) if peak.exists() else 0
    return {"seconds": round(time.perf_counter() - started, 1),
            "peak_bytes": maxrss * (1 if sys.platform == "darwin" else 1024),  # ru_maxrss: KB on Linux
            "exit": code, "last_line": lines[-1] if lines else ""}


class Bench:
    """The stages run so far, each a row: name, measurements, output size, the size its ratio is taken over."""

    def __init__(self, work: Path):
        self.work, self.rows = work, []

    def stage(self, name: str, command: list, out: Path | None, yardstick: Path | None, writes: bool) -> dict:
        print(f"[{name}] {' '.join(map(str, command))}", flush=True)
        row = {"stage": name, **run_stage(command, self.work / f"{name}.log")}
        row["written_bytes"] = directory_bytes(out) if out is not None and row["exit"] == 0 else 0
        base = row["written_bytes"] if writes else directory_bytes(yardstick) if yardstick is not None else 0
        row["ratio"] = round(row["peak_bytes"] / base, 2) if base and row["exit"] == 0 else None
        row["ratio_of"] = "written" if writes else "read"
        self.rows.append(row)
        status = "ok" if row["exit"] == 0 else f"exit {row['exit']}: {row['last_line']}"
        print(f"[{name}] {row['seconds']} s, peak {row['peak_bytes'] / GIB:.2f} GiB, {status}", flush=True)
        return row

    def table(self) -> str:
        rows = []
        for row in self.rows:
            minutes, seconds = divmod(int(row["seconds"]), 60)
            ratio = f"{row['ratio']:.2f}x ({row['ratio_of']})" if row["ratio"] else (
                "" if row["exit"] == 0 else f"refused or failed: {row['last_line'][:160]}")
            written = f"{row['written_bytes'] / GIB:.2f} GiB" if row["written_bytes"] else ""
            peak = f"{row['peak_bytes'] / GIB:.2f} GiB"
            rows.append([row["stage"], f"{minutes}:{seconds:02d}", peak, written, ratio])
        return markdown_table(["stage", "wall", "peak RSS", "written", "peak / weights"], rows)


def _decode(bench: Bench, lowered: Path) -> dict:
    """Greedy and DFlash twice each: tokens identical?, tokens/s per run."""
    found: dict[str, list] = {"greedy": [], "dflash": []}
    for attempt in (1, 2):
        for mode in found:
            name = f"generate-{mode}-{attempt}"
            row = bench.stage(name, [*CLI, "generate", lowered, "--prompt-ids", PROMPT, "--max-new-tokens", "16",
                                     "--mode", mode, "--json"], None, lowered, writes=False)
            if row["exit"] == 0:
                text = (bench.work / f"{name}.log").read_text()
                found[mode].append(json.loads(text[text.index("{"):text.rindex("}") + 1]))
    if not all(found.values()):
        return {"identical": None}
    return {"identical": all(r["tokens"] == found["greedy"][0]["tokens"] for runs in found.values() for r in runs),
            "tokens_per_second": {mode: [round(r["tokens_per_second"], 2) for r in runs]
                                  for mode, runs in found.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-4b-shaped",
                        help="a exporter.tiny preset: qwen3-4b-shaped, llama3.1-8b-shaped, qwen3.5-4b-shaped, "
                             "gpt-oss-20b-shaped, qwen3-0.6b-shaped")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--lean", action="store_true", help="delete the pair and the float16 export once read")
    parser.add_argument("--ai100", action="store_true", help="also lower --target ai100 --dry-run (ctx 4096)")
    parser.add_argument("--mlx", action="store_true", help="also lower --target mlx --bits 4")
    parser.add_argument("--coreml", action="store_true", help="also lower --target coreml --bits 4 --layers-per-part 6")
    parser.add_argument("--json", type=Path, help="write the rows and the decode comparison here")
    args = parser.parse_args(argv)
    work = args.work.expanduser()
    work.mkdir(parents=True, exist_ok=True)
    for name in ("pair", "onnx", "int4", "ort"):
        if (work / name).exists():
            raise SystemExit(f"{work / name} exists: give an empty --work (every stage is measured from scratch)")
    bench = Bench(work)
    pair, onnx, int4, ort = work / "pair", work / "onnx", work / "int4", work / "ort"
    decoded: dict = {}
    if bench.stage("pair", [sys.executable, "-m", "dflash_onnx.exporter.tiny", "--preset", args.preset, "--out", pair],
                   pair, None, writes=True)["exit"] == 0 and \
            bench.stage("export", [*CLI, "export", "--target", pair / "target", "--draft", pair / "draft",
                                   "--dtype", "float16", "--out", onnx], onnx, None, writes=True)["exit"] == 0:
        extra = [(flag, target, options) for flag, target, options in (
            (args.ai100, "ai100", ["--dry-run", "--ctx-len", "4096"]), (args.mlx, "mlx", ["--bits", "4"]),
            (args.coreml, "coreml", ["--bits", "4", "--layers-per-part", "6"])) if flag]
        if args.lean and not any(target in ("ai100", "coreml") for _, target, _ in extra):
            shutil.rmtree(pair)  # the AI 100 and CoreML lowerings re-export from the checkpoints
        if bench.stage("optimize-int4", [*CLI, "optimize", onnx, "--passes", "int4", "--pass-option",
                                         "int4.lm_head=true", "--out", int4], int4, None, writes=True)["exit"] == 0:
            if args.lean and not extra:  # nothing reads the float16 export again: its disk goes to the lowering
                shutil.rmtree(onnx, ignore_errors=True)
            if bench.stage("lower-ort", [*CLI, "lower", int4, "--target", "ort", "--out", ort], ort, int4,
                           writes=False)["exit"] == 0:
                decoded = _decode(bench, ort)
        for _, target, options in extra:
            out = work / target
            bench.stage(f"lower-{target}", [*CLI, "lower", onnx, "--target", target, *options, "--out", out], out,
                        onnx, writes=False)
        if args.lean and all(row["exit"] == 0 for row in bench.rows):  # a failed stage keeps what it read
            shutil.rmtree(onnx, ignore_errors=True)
            shutil.rmtree(pair, ignore_errors=True)
    text = bench.table() + "\n\n" + provenance()
    if decoded:
        text += (f"\n\ngreedy and DFlash tokens identical: {decoded['identical']}; tokens/s "
                 + ", ".join(f"{mode} {' / '.join(map(str, rates))}"
                             for mode, rates in decoded.get("tokens_per_second", {}).items()))
    (work / "table.md").write_text(text + "\n")
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "rows": bench.rows, "decode": decoded}, indent=1))


if __name__ == "__main__":
    main()
