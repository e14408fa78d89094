"""Measured figures as the docs print them: a Markdown table and, under it, the line that names the command,
the date and the machine, so that refreshing a table in docs/ is one command and its output pasted in."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import sys
from collections.abc import Sequence
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
    command = command_line(sys.argv if argv is None else argv)
    return f"{verb} {datetime.date.today().isoformat()} on {machine(libraries)}: `{command}`."


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; cells are printed as they are given (format numbers before)."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
