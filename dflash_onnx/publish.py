"""Writing an output directory: every writer (export, optimize, each lowering, distill) publishes through here.

A directory is built in a temporary sibling and renamed into place only when complete, so a failed or
interrupted run never leaves a half-written directory, and an existing one is replaced only on success.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import DFlashError

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json",
)


def check_out_dir(out: Path, sources: tuple[Path, ...], overwrite: bool) -> None:
    """Refuse an --out that exists (unless `overwrite`), is a file, or would replace one of `sources`."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DFlashError(f"{out} exists and is not a directory: choose another --out")
    if out.exists() and not overwrite:
        raise DFlashError(f"{out} already exists: choose another --out or pass --overwrite")
    resolved = out.resolve()
    for source in sources:
        if resolved == Path(source).resolve() or resolved in Path(source).resolve().parents:
            raise DFlashError(f"--out {out} would replace the model directory {source}: choose another --out")


@contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """A temporary sibling of `out` to write into: published as `out` on success, removed on any error."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished directory into place; an old `out` is set aside first and removed only after."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def copy_tokenizer_files(source: Path, dest: Path) -> list[str]:
    """Copy the tokenizer and generation-config files `source` has into `dest`; return their names."""
    copied = [f for f in TOKENIZER_FILES if (Path(source) / f).is_file()]
    for name in copied:
        shutil.copy2(Path(source) / name, Path(dest) / name)
    return copied
