"""Writing an output directory: every writer (export, optimize, each lowering, distill) publishes here.

A directory is built in a staging sibling `.NAME.staging-PID` and published whole: on Linux with one
atomic exchange (`renameat2(RENAME_EXCHANGE)`), so OUT names a complete directory at every instant, the old
one until the exchange and the new one after it; elsewhere (or on a filesystem without the call) with two
renames. While a writer runs, OUT is locked (`.NAME.lock`, flock): a second writer fails at once. Staging
and scratch directories of runs that died (their process is gone) are removed by the next writer of the same
OUT; free space is compared with what the writer says it needs before anything is written.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dflash_onnx.runtime.errors import DFlashError

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json",
)
AT_FDCWD, RENAME_NOREPLACE, RENAME_EXCHANGE = -100, 1, 2
_HELD: set[Path] = set()  # outputs this process holds the lock of (a writer inside a writer re-enters)


def check_out_dir(out: Path, sources: tuple[Path, ...], overwrite: bool) -> None:
    """Refuse an --out that exists (unless `overwrite`), is a file, sits below a file, would replace one of
    `sources`, or whose directory cannot be written in. Cheap: writers call it before any work, and again under
    the lock."""
    out = Path(out)
    resolved = out.resolve()
    for source in sources:
        if resolved == Path(source).resolve() or resolved in Path(source).resolve().parents:
            raise DFlashError(f"--out {out} would replace the model directory {source}: choose another --out")
    if out.exists() and not out.is_dir():
        raise DFlashError(f"{out} exists and is not a directory: choose another --out")
    if out.exists() and not overwrite:
        raise DFlashError(f"{out} already exists: choose another --out or pass --overwrite")
    for ancestor in out.absolute().parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise DFlashError(f"--out {out}: {ancestor} is a file, not a directory: choose another --out")
            break
    if out.parent.is_dir():  # a place the writer may not write in fails now, not after minutes of work
        probe = out.parent / f".{out.name}.probe-{os.getpid()}"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return
        except OSError as exc:
            raise DFlashError(f"--out {out}: cannot write in {out.parent} ({exc.strerror})") from None
        probe.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _clean_stale(out: Path) -> list[Path]:
    """Remove the staging, scratch and set-aside directories of earlier writers of `out` whose process is gone."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(staging|scratch|old)-(\d+)(-\d+)?$")
    removed = []
    for entry in out.parent.iterdir() if out.parent.is_dir() else []:
        match = pattern.match(entry.name)
        if match and int(match.group(2)) != os.getpid() and not _alive(int(match.group(2))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


@contextmanager
def lock_out(out: Path) -> Iterator[None]:
    """Hold the lock of `out` for the block: a second writer of the same OUT fails at once, in one line.
    Re-entrant within a process; a no-op where flock does not exist."""
    out = Path(out).absolute()
    try:
        import fcntl
    except ImportError:
        yield
        return
    if out in _HELD:
        yield
        return
    path = out.parent / f".{out.name}.lock"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise DFlashError(f"--out {out}: cannot write in {out.parent} ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            raise DFlashError(f"another dflash-onnx (pid {holder}) is writing {out}: wait for it to finish, or "
                              "choose another --out") from None
        if not path.exists() or os.stat(path).st_ino != os.fstat(fd).st_ino:  # unlinked by a finishing writer
            raise DFlashError(f"{out} was being published by another dflash-onnx: run again")
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        _HELD.add(out)
        try:
            yield
        finally:
            _HELD.discard(out)
            path.unlink(missing_ok=True)  # while still holding it: a waiter then sees a stale inode
    finally:
        os.close(fd)


def _side_directory(out: Path, kind: str) -> Path:
    """A new `.NAME.<kind>-PID` directory beside `out`."""
    for attempt in range(1000):
        path = out.parent / f".{out.name}.{kind}-{os.getpid()}{f'-{attempt}' if attempt else ''}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
        except OSError as exc:
            raise DFlashError(f"--out {out}: cannot write in {out.parent} ({exc.strerror})") from None
    raise DFlashError(f"--out {out}: cannot create a staging directory in {out.parent}")


def _size(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


MEMORY_CHECK_ENV = "DFLASH_ONNX_NO_MEMORY_CHECK"


def available_memory() -> int | None:
    """Bytes the kernel can still hand out (MemAvailable + SwapFree); None where it does not say (not Linux)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    values = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if rest.split():
            values[key] = int(rest.split()[0]) * 1024
    return values["MemAvailable"] + values.get("SwapFree", 0) if "MemAvailable" in values else None


def _check_memory(out: Path, need_bytes: int, hint: str = "") -> None:
    """Refuse up front a stage whose measured peak (its factor times its weights) exceeds what is available;
    `hint`: what else the user can do."""
    if need_bytes <= 0 or os.environ.get(MEMORY_CHECK_ENV):
        return
    available = available_memory()
    if available is not None and need_bytes > available:
        hint = hint or "close other programs or use a machine with more memory"
        raise DFlashError(f"writing {out} needs about {_size(need_bytes)} of memory at its peak and this machine has "
                          f"{_size(available)} available (RAM + swap): {hint} (set {MEMORY_CHECK_ENV}=1 to try "
                          "anyway)")


def _check_space(out: Path, need_bytes: int) -> None:
    free = shutil.disk_usage(out.parent).free
    if need_bytes > free:
        raise DFlashError(f"--out {out}: this needs about {_size(need_bytes)} and {out.parent} has {_size(free)} "
                          "free: free some space or choose another --out")


@contextmanager
def staged_directory(out: Path, sources: tuple[Path, ...] = (), overwrite: bool = False,
                     need_bytes: int = 0, need_memory: int = 0, memory_hint: str = "") -> Iterator[Path]:
    """A staging directory to write `out` into, published whole on success and removed on any error. Under
    the lock of `out`: the --out checks again, stale staging of dead runs removed, free space and (where the
    caller estimates it) memory checked."""
    out = Path(out)
    with lock_out(out):
        check_out_dir(out, sources, overwrite)
        _clean_stale(out)
        _check_space(out, need_bytes)
        _check_memory(out, need_memory, memory_hint)
        staging = _side_directory(out, "staging")
        try:
            yield staging
            _publish(staging, out, overwrite)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


@contextmanager
def scratch_directory(out: Path) -> Iterator[Path]:
    """A scratch directory beside `out` for intermediate files, removed afterwards (or by the next writer of
    `out` when this process is killed)."""
    scratch = _side_directory(Path(out), "scratch")
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _renameat2(source: Path, dest: Path, flags: int) -> bool:
    """Linux renameat2; False where the platform or the filesystem lacks it (the caller falls back)."""
    call = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform.startswith("linux") else None
    if call is None:
        return False
    if call(AT_FDCWD, os.fsencode(source), AT_FDCWD, os.fsencode(dest), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(dest))


def _exchange(staging: Path, out: Path) -> bool:
    """Swap `staging` and `out` in one step; False where that cannot be done here."""
    return _renameat2(staging, out, RENAME_EXCHANGE)


def _publish(staging: Path, out: Path, overwrite: bool) -> None:
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    if out.exists():
        if not overwrite:
            raise DFlashError(f"{out} appeared while this ran: choose another --out or pass --overwrite")
        if _exchange(staging, out):  # `staging` now holds the old directory
            shutil.rmtree(staging, ignore_errors=True)
            return
        old = _side_directory(out, "old")
        os.replace(out, old / out.name)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        if not _renameat2(staging, out, RENAME_NOREPLACE):
            os.rename(staging, out)
    except FileExistsError:
        raise DFlashError(f"{out} appeared while this ran: choose another --out or pass --overwrite") from None


def directory_bytes(path: Path) -> int:
    """Bytes of the files in `path` (what writing a directory like it takes)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def copy_tokenizer_files(source: Path, dest: Path) -> list[str]:
    """Copy the tokenizer and generation-config files `source` has into `dest`; return their names."""
    copied = [f for f in TOKENIZER_FILES if (Path(source) / f).is_file()]
    for name in copied:
        shutil.copy2(Path(source) / name, Path(dest) / name)
    return copied
