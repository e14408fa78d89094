"""Names read from an artifact (graph files in dflash.json, external-data locations inside a graph,
tokenizer files) are plain relative names that stay inside their directory, symlinks included: a
tampered artifact cannot make dflash-onnx open files elsewhere. Checked before any file is opened."""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath

from dflash_onnx.runtime.errors import DFlashError


def member(directory: Path, name: str, what: str) -> Path:
    """`directory / name`, refused unless `name` is relative, has no '..' and resolves inside `directory`."""
    directory = Path(directory)
    if not isinstance(name, str):
        raise DFlashError(f"{what} is {name!r}, not a file name: the artifact is damaged; write it again")
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if not name or PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or ".." in parts:
        raise DFlashError(f"{what} names {name!r}, which is not a plain relative name inside {directory}: the "
                          "artifact is damaged or was tampered with; write it again")
    path = directory / name
    root = directory.resolve()
    if path.resolve() != root and root not in path.resolve().parents:
        raise DFlashError(f"{what} {name!r} leads outside {directory} (to {path.resolve()}): the artifact is "
                          "damaged or was tampered with; write it again")
    return path
