"""Measured figures as the docs print them: a Markdown table and, under it, the line that names the command,
the date and the machine, so that refreshing a table in docs/ is one command and its output pasted in.

A command that writes `--json` puts the table there too, as a record (`figures_record`): kept beside the docs as
docs/figures/NAME.json, it is the table's one source, and `render` (`python -m dflash_onnx.figures FILE`) gives the
text the page prints, which tests/test_figures_agree.py holds the page to."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def _cpu_model() -> str:
    """The CPU's marketing name (Linux: /proc/cpuinfo; elsewhere what the platform module knows)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware")):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def machine(libraries: Sequence[str] = ("onnxruntime",)) -> str:
    """This machine in a few words: CPU, cores, memory, OS, and the versions of `libraries` installed."""
    memory = _memory_gib()
    parts = [f"{_cpu_model()}, {os.cpu_count()} cores", *([f"{memory:.0f} GiB"] if memory else []),
             platform.system()]
    for library in libraries:
        try:
            parts.append(f"{library} {importlib.metadata.version(library)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(parts)


def command_line(argv: Sequence[str]) -> str:
    """`argv` as a user would type it: `dflash-onnx ...` for the CLI however it was started, `python SCRIPT ...`
    for a script (its path relative to the working directory where it lies below it)."""
    program, *rest = argv
    path = Path(program)
    if path.name in ("dflash-onnx", "cli.py") or path.parent.name == "dflash_onnx":
        head = ["dflash-onnx"]
    elif path.suffix == ".py":
        try:
            head = ["python", str(path.resolve().relative_to(Path.cwd()))]
        except ValueError:
            head = ["python", str(path)]
    else:
        head = [path.name]
    return shlex.join([*head, *rest])


def provenance(argv: Sequence[str] | None = None, libraries: Sequence[str] = ("onnxruntime",),
               verb: str = "Measured") -> str:
    """The line under a table: when, where and by which command it was measured (or, for a replay, computed)."""
    return provenance_line(_stamp(argv, libraries, verb))


def _stamp(argv: Sequence[str] | None, libraries: Sequence[str], verb: str) -> dict:
    """What the line under a table says, as data, so that a kept record prints the same line."""
    return {"verb": verb, "date": datetime.date.today().isoformat(), "machine": machine(libraries),
            "command": command_line(sys.argv if argv is None else argv)}


def provenance_line(stamp: Mapping) -> str:
    """The line under a table from its record's verb, date, machine and command."""
    return f"{stamp['verb']} {stamp['date']} on {stamp['machine']}: `{stamp['command']}`."


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; cells are printed as they are given (format numbers before)."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


FIGURES_KEYS = ("verb", "date", "machine", "command", "header", "rows", "caption")


def figures_record(header: Sequence[str], rows: Sequence[Sequence[object]], caption: str = "",
                   argv: Sequence[str] | None = None, libraries: Sequence[str] = ("onnxruntime",),
                   verb: str = "Measured") -> dict:
    """A table with its caption and provenance as JSON data, for a command's `--json` output: the file it is
    written to can be kept in docs/figures/ and the page's table regenerated from it (`render`) without measuring
    again. `verb` is "Measured" for timings, "Computed" for a replay or a simulation."""
    return {**_stamp(argv, libraries, verb), "header": [str(h) for h in header],
            "rows": [[str(cell) for cell in row] for row in rows], "caption": caption}


def render(record: Mapping) -> str:
    """The table, its caption and its provenance line as docs/ prints them (what the command printed)."""
    line = provenance_line(record)
    under = f"{record['caption']} {line}" if record.get("caption") else line
    return f"{markdown_table(record['header'], record['rows'])}\n\n{under}"


def read_figures(path: Path | str) -> dict:
    """The figures record of a JSON file a command wrote: the record itself, or a report holding it under
    "figures" (as `bench --json` writes it)."""
    data = json.loads(Path(path).read_text())
    record = data.get("figures", data) if isinstance(data, dict) else None
    missing = [key for key in FIGURES_KEYS if not isinstance(record, dict) or key not in record]
    if missing:
        raise ValueError(f"{path}: not a figures record (missing {', '.join(missing)})")
    return record


def main(argv: Sequence[str] | None = None) -> None:
    """python -m dflash_onnx.figures FILE...: each kept file's table as its page prints it, to paste there."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        raise SystemExit("usage: python -m dflash_onnx.figures FILE.json [FILE.json ...]")
    print("\n\n".join(render(read_figures(path)) for path in paths))


if __name__ == "__main__":
    main()
