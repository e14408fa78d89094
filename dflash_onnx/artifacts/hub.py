"""Checkpoints by Hugging Face hub name: a name that is not a directory is fetched with huggingface_hub's
`snapshot_download` (its cache, HF_HOME / HF_HUB_CACHE, HF_TOKEN and HF_HUB_OFFLINE as it reads them; its progress
bars), and only the files dflash-onnx reads: config.json, the safetensors weights and their index, the tokenizer,
chat-template and generation-config files. Code (`*.py`), pickles (`*.bin`, `*.pt`, ...) and subfolders are never
fetched; a snapshot that holds them (another tool fetched the whole repo) is read as any directory is
(model_dirs.py: configs as data, safetensors only), so they are never run or copied either.

A pair finds its other half here too: a speculators-format draft names its verifier in its config; a z-lab draft's
target, and a target's z-lab draft (`--draft auto`), come from published_pairs.py. A snapshot's repo id and commit
are read back from its path (`models--ORG--NAME/snapshots/COMMIT`): the export records them in dflash.json, and
parity and bench fetch them again when the recorded directory is gone. torch-free.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path

from dflash_onnx.artifacts.model_dirs import CONVERT, read_config
from dflash_onnx.artifacts.published_pairs import described, published_draft, published_draft_for
from dflash_onnx.runtime.errors import DFlashError

# all dflash-onnx reads from a checkpoint, so all it fetches (publish.TOKENIZER_FILES and chat_template.json)
ALLOW_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
                  "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json")
# never fetched, whatever the patterns above match: code, pickle weights, and anything below the top level
IGNORE_PATTERNS = ("*.py", "*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt", "*/*")
AUTO = "auto"  # --draft auto: the published draft of --target
REVISION_FLAG = {"target": "--revision", "draft": "--draft-revision"}
COMMIT = re.compile(r"[0-9a-f]{40}")


def is_repo_id(name: str) -> bool:
    """An `org/name` the hub accepts as a model id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _looks_like_path(name: str) -> bool:
    return os.path.isabs(name) or name.startswith((".", "~")) or "\\" in name or name.count("/") > 1


def hf_download_command(repo_id: str, revision: str) -> str:
    """The `hf download` line that fetches what dflash-onnx reads of `repo_id` into the cache."""
    included = " ".join(f"--include {shlex.quote(p)}" for p in ALLOW_PATTERNS)  # hf takes one pattern a flag
    return f"hf download {repo_id} --revision {shlex.quote(revision)} {included} --exclude '*/*'"


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in (
        "1", "ON", "YES", "TRUE")


@contextmanager
def _progress_bars(show: bool):
    """The hub's own progress bars while fetching, unless `show` is off (then restored as they were)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if show or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _snapshot(repo_id: str, kind: str, revision: str | None, progress: bool) -> Path:
    from huggingface_hub import constants, errors, snapshot_download

    from dflash_onnx.runtime import __version__

    revision = revision or "main"
    offline = _offline()
    fetch = hf_download_command(repo_id, revision)
    missing = (errors.LocalEntryNotFoundError,) + tuple(
        getattr(errors, name) for name in ("IncompleteSnapshotError",) if hasattr(errors, name))
    try:
        with _progress_bars(progress):
            folder = Path(snapshot_download(
                repo_id, revision=revision, allow_patterns=list(ALLOW_PATTERNS), ignore_patterns=list(IGNORE_PATTERNS),
                local_files_only=offline, library_name="dflash-onnx", library_version=__version__))
    except errors.RevisionNotFoundError:
        raise DFlashError(f"{kind} {repo_id} has no revision {revision!r} on the Hugging Face hub: check "
                          f"{REVISION_FLAG[kind]}") from None
    except errors.GatedRepoError:
        raise DFlashError(f"{kind} {repo_id} is gated on the Hugging Face hub: accept its terms at "
                          f"https://huggingface.co/{repo_id}, then set HF_TOKEN (or run 'hf auth login')") from None
    except errors.RepositoryNotFoundError:
        raise DFlashError(f"{kind} {repo_id} is neither a directory nor a model on the Hugging Face hub (a private "
                          "one needs HF_TOKEN)") from None
    except missing as exc:
        why = ("HF_HUB_OFFLINE is set" if offline else
               f"the hub cannot be reached ({_first_line(exc.__cause__ or exc)})")
        raise DFlashError(f"{kind} {repo_id} (revision {revision}) is not a directory and not in the Hugging Face "
                          f"cache ({constants.HF_HUB_CACHE}), and {why}: fetch it where the hub is reachable with: "
                          f"{fetch}") from None
    except errors.HfHubHTTPError as exc:
        raise DFlashError(f"the Hugging Face hub refused {kind} {repo_id}: {_first_line(exc)}") from None
    if not (folder / "config.json").is_file():
        raise DFlashError(f"{kind} {repo_id} (revision {revision}) has no config.json: it is not a transformers "
                          "checkpoint dflash-onnx can read")
    if not any(folder.glob("*.safetensors")):
        raise DFlashError(f"{kind} {repo_id} (revision {revision}) has no safetensors weights; dflash-onnx never "
                          f"fetches or loads pickle weights (*.bin, *.pt), which can run code: {CONVERT}")
    if progress:
        print(f"{kind} {repo_id} at {folder.name}: {folder}", file=sys.stderr, flush=True)
    return folder


def resolve_checkpoint(name: str | Path, kind: str, revision: str | None = None, progress: bool = True) -> Path:
    """The checkpoint directory `name` stands for: a directory as it is; else an `org/name` hub id, from the
    Hugging Face cache or fetched into it (`revision`: a branch, tag or commit; default main). `kind`: "target" or
    "draft", for the messages."""
    path = _checked_name(name, kind, revision)
    return path if path is not None else _snapshot(str(name), kind, revision, progress)


def _checked_name(name: str | Path, kind: str, revision: str | None) -> Path | None:
    """The directory `name` is; None for a hub id; a one-line error for anything else (nothing fetched)."""
    text = str(name)
    path = Path(text).expanduser()
    if path.is_dir():
        if revision:
            raise DFlashError(f"{REVISION_FLAG[kind]} {revision} names a hub revision, but {kind} {text} is a "
                              "directory")
        return path
    if path.exists() or _looks_like_path(text):
        read_config(path, kind)  # says what is wrong with it
    if not is_repo_id(text):
        raise DFlashError(f"{kind} {text!r} is neither a directory nor a Hugging Face hub name (org/name)")
    return None


def snapshot_origin(directory: Path) -> dict[str, str] | None:
    """{"repo_id", "revision"} of a directory in the Hugging Face cache (`models--ORG--NAME/snapshots/COMMIT`);
    None for any other directory."""
    resolved = Path(directory).resolve()
    repo = resolved.parent.parent.name
    if resolved.parent.name != "snapshots" or not COMMIT.fullmatch(resolved.name) or not repo.startswith("models--"):
        return None
    return {"repo_id": repo.removeprefix("models--").replace("--", "/"), "revision": resolved.name}


def _hub_name(name: str | Path, directory: Path) -> str | None:
    """The hub id a checkpoint goes by: its cache snapshot's, else the name it was given when that is one."""
    origin = snapshot_origin(directory)
    return origin["repo_id"] if origin else (str(name) if is_repo_id(str(name)) else None)


def _note(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


def _target_named_by(draft: str | Path, draft_dir: Path, progress: bool) -> str:
    """The target a draft names: a speculators draft's verifier, or a published z-lab draft's pair."""
    config = read_config(draft_dir, "draft")
    if "speculators_model_type" in config:
        verifier = (config.get("speculators_config") or {}).get("verifier") or {}
        named = verifier.get("name_or_path") if isinstance(verifier, dict) else None
        if isinstance(named, str) and named.strip():
            _note(progress, f"target {named}: the draft's verifier (speculators_config.verifier.name_or_path)")
            return named.strip()
        raise DFlashError(f"draft {draft} names no verifier (its speculators_config.verifier.name_or_path is empty): "
                          "pass --target")
    hub_name = _hub_name(draft, draft_dir)
    entry = published_draft(hub_name) if hub_name else None
    if entry is None:
        raise DFlashError(f"draft {draft} does not name its target (neither a speculators draft naming its verifier "
                          "nor a published z-lab draft, dflash_onnx/artifacts/published_pairs.py): pass --target")
    _note(progress, f"target {entry.target}: the published pair of {described(entry)}")
    return entry.target


def resolve_pair(target: str | Path | None, draft: str | Path | None, revision: str | None = None,
                 draft_revision: str | None = None, progress: bool = True) -> tuple[Path, Path]:
    """The target and draft directories of an export: each a directory or a hub name; `target` None takes the
    one the draft names, `draft` "auto" the published draft of `target`."""
    if draft is None:
        raise DFlashError("pass --draft: a draft directory, a hub name, or auto (the published draft of --target)")
    if str(draft) == AUTO:
        if target is None:
            raise DFlashError("--draft auto picks the published draft of --target: pass --target too")
        target_dir = resolve_checkpoint(target, "target", revision, progress)
        hub_name = _hub_name(target, target_dir)
        entry = published_draft_for(hub_name) if hub_name else None
        if entry is None:
            raise DFlashError(f"--draft auto: no published draft is known for {hub_name or target} (dflash_onnx/"
                              "artifacts/published_pairs.py lists z-lab's): pass --draft DIR or a hub name")
        _note(progress, f"draft {described(entry)}: the published draft of {entry.target}")
        return target_dir, resolve_checkpoint(entry.draft, "draft", draft_revision, progress)
    if target is not None:
        _checked_name(draft, "draft", draft_revision)  # both names checked before either is fetched
        target_dir = resolve_checkpoint(target, "target", revision, progress)
        return target_dir, resolve_checkpoint(draft, "draft", draft_revision, progress)
    draft_dir = resolve_checkpoint(draft, "draft", draft_revision, progress)
    named = _target_named_by(draft, draft_dir, progress)
    try:
        return resolve_checkpoint(named, "target", revision, progress), draft_dir
    except DFlashError as exc:
        raise DFlashError(f"{exc} (the target draft {draft} names; pass --target to choose one)") from None


def checkpoints(manifest, target: str | Path | None = None, draft: str | Path | None = None,
                revision: str | None = None, draft_revision: str | None = None,
                progress: bool = True, flag: str = "--{kind}") -> tuple[Path, Path]:
    """An export's checkpoints for parity, the bench's peers and the lowerings that convert them again: those given
    (directories or hub names; a hub name the export recorded defaults to the recorded commit), else the
    directories recorded at export, else the hub ids and commits recorded there (from the cache, or fetched
    again). `flag`: how the command names the option that gives one, for its messages."""
    chosen: dict[str, Path | None] = {}
    for kind, given, rev in (("target", target, revision), ("draft", draft, draft_revision)):
        recorded = manifest.hub.get(kind) or {}
        directory = manifest.source_dirs.get(kind)
        if given is not None:
            same = str(given).casefold() == recorded.get("repo_id", "").casefold() and not Path(str(given)).is_dir()
            chosen[kind] = resolve_checkpoint(given, kind, rev or (recorded.get("revision") if same else None),
                                              progress)
        elif rev:
            if not recorded:
                raise DFlashError(f"{REVISION_FLAG[kind]} is a hub revision, and this export records no hub name for "
                                  f"its {kind}: pass {flag.format(kind=kind)} NAME too")
            chosen[kind] = resolve_checkpoint(recorded["repo_id"], kind, rev, progress)
        elif recorded and not (directory and (Path(directory) / "config.json").is_file()):
            chosen[kind] = resolve_checkpoint(recorded["repo_id"], kind, recorded.get("revision"), progress)
        else:
            chosen[kind] = None
    return manifest.checkpoints(chosen["target"], chosen["draft"], flag=flag)
