"""What a backend is to the rest of the program: a name, its `lower` flags and options record, a lowering,
a session factory, and which directories it can open. Each `targets/<backend>/__init__.py` builds one;
`targets/__init__.py` registers them. Nothing here imports a backend's runtime or torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.runtime.session import Session


@dataclass(frozen=True)
class Flag:
    """One `lower` flag of a backend and the options field it sets; its default is the field's default."""

    name: str  # "--ctx-len"
    field: str  # the options record's field
    help: str
    type: Callable[[str], Any] = str
    choices: tuple | None = None
    switch: bool = False  # a flag without a value (store_true)
    parse: Callable[[Any], Any] | None = None  # the flag's value -> the field's value

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class LowerRequest:
    """What every lowering takes besides its options: how to write, and where the checkpoints are (the
    lowerings that convert the checkpoints again default to those the export recorded)."""

    overwrite: bool = False
    progress: bool = True
    target_dir: str | Path | None = None  # a directory or a hub name
    draft_dir: str | Path | None = None


def validate_before_import(source: Path, options: Any) -> None:
    """Check a lowering's options against the export before importing a lowering whose imports take seconds
    (torch, for AI 100 and CoreML): a bad flag fails at once. The lowering checks them again."""
    from dflash_onnx.runtime.manifest import load_export

    options.validate(load_export(source, "lower").block_size)


def recorded_options(options_type: type, manifest: Manifest) -> Any:
    """The options record a lowering wrote into the manifest, as `options_type` (refused in one line when this
    dflash-onnx's backend does not know them: a directory from another version)."""
    try:
        return options_type(**manifest.lowering.options)
    except TypeError as exc:
        raise DFlashError(f"the manifest's {manifest.backend} options do not match this dflash-onnx ({exc}): re-run "
                          "'dflash-onnx lower' on the export") from None


def own_lowerings_only(name: str, title: str) -> Callable[[Path, Manifest], str | None]:
    """`can_open` of a backend that runs only directories lowered for it."""
    def can_open(directory: Path, manifest: Manifest) -> str | None:
        if manifest.backend == name:
            return None
        return (f"{directory} is not a {title} lowering: run 'dflash-onnx lower OUT --target {name} --out DIR' "
                "first")

    return can_open


@dataclass(frozen=True)
class Backend:
    name: str  # the value of `lower --target` and `--backend`
    title: str  # how help text and messages name it
    options_type: type  # a dataclass: the lowering's options, recorded in the manifest
    flags: tuple[Flag, ...]
    reexports: bool  # the lowering converts the checkpoints again (takes --target-dir / --draft-dir)
    lower: Callable[[Path, Path, Any, LowerRequest], Manifest]
    summary: Callable[[Manifest, Path], str]  # what `lower` prints when done
    # None when this backend can run `manifest`'s directory here, else why not and what to do
    can_open: Callable[[Path, Manifest], str | None]
    open_session: Callable[..., Session]  # (directory, manifest, "target" | "draft", **overrides)
    session_options: tuple[str, ...] = ()  # the overrides open_session takes (open_decoder's keywords)

    def default(self, flag: Flag) -> Any:
        """The field default a flag stands for (what the options record holds when the flag is not given)."""
        return next(f.default for f in fields(self.options_type) if f.name == flag.field)

    def options(self, given: dict[str, Any]) -> Any:
        """The options record from the flags given (by flag name, raw values); the rest keep their defaults."""
        known = {flag.name: flag for flag in self.flags}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise DFlashError(f"{', '.join(unknown)}: not an option of --target {self.name}")
        values = {}
        for name, value in given.items():
            flag = known[name]
            values[flag.field] = flag.parse(value) if flag.parse else value
        return self.options_type(**values)
