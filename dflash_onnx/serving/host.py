"""An Engine opened from a directory by plain settings: what `dflash-onnx serve` runs, and what other hosts open in
their own processes (a Ray Serve replica, Triton's Python backend), so every host gets the same checks and the same
engine from the same flags."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.policy import parse_verify
from dflash_onnx.serving.engine import Engine


@dataclass(frozen=True)
class EngineSettings:
    """The serve flags that shape the engine; `check()` refuses bad ones in one line before any session opens."""

    directory: Path | str
    backend: str | None = None
    max_batch: int = 1  # requests decoded side by side (a lowering with --kv-attention ragged); 1: one at a time
    shared_draft: bool = True  # side by side, greedy requests' drafts as one call a step where the lowering can
    max_queue: int = 16
    max_prompt_tokens: int | None = None  # longer prompts get 400; None: as long as the lowering holds
    prefill_chunk: int = 256  # the most prompt tokens one prefill call takes (between calls, others decode)
    verify: str = "auto"
    batch_invariant: bool = True
    lookup_guess: bool = True
    cost_model: Path | str | None = None  # a cost curve measured elsewhere, instead of the directory's
    session_options: dict = field(default_factory=dict)  # the backend's session overrides (coreml: compute_units)

    def __post_init__(self):
        object.__setattr__(self, "directory", Path(self.directory))  # a str path is taken as given
        if self.cost_model is not None:
            object.__setattr__(self, "cost_model", Path(self.cost_model))

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> EngineSettings:
        """From string key/values, as Ray's `serve run module:app key=value` and Triton's config parameters give
        them (the keys are the field names; unknown keys are refused, naming the known ones)."""
        known = {f.name for f in fields(cls)} - {"session_options"} | {"compute_units"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise DFlashError(f"unknown engine setting(s) {', '.join(unknown)}: known are {', '.join(sorted(known))}")
        if not values.get("directory"):
            raise DFlashError("the engine needs directory=PATH: an exported or lowered directory")

        def whole(key: str, default: int) -> int:
            text = str(values.get(key, default)).strip()
            if not text.lstrip("-").isdigit():
                raise DFlashError(f"{key} must be a whole number, got {text!r}")
            return int(text)

        def switch(key: str) -> bool:
            text = str(values.get(key, "on")).strip().lower()
            if text not in ("on", "off", "true", "false", "1", "0"):
                raise DFlashError(f"{key} must be on or off, got {text!r}")
            return text in ("on", "true", "1")

        return cls(directory=Path(values["directory"]), backend=values.get("backend") or None,
                   max_batch=whole("max_batch", 1), shared_draft=switch("shared_draft"),
                   max_queue=whole("max_queue", 16), prefill_chunk=whole("prefill_chunk", 256),
                   max_prompt_tokens=whole("max_prompt_tokens", 0) or None,
                   verify=str(values.get("verify", "auto")), batch_invariant=switch("batch_invariant"),
                   lookup_guess=switch("lookup_guess"),
                   cost_model=Path(values["cost_model"]) if values.get("cost_model") else None,
                   session_options={"compute_units": values["compute_units"]} if values.get("compute_units") else {})

    def check(self) -> None:
        limits = {"max_queue": self.max_queue, "max_batch": self.max_batch, "prefill_chunk": self.prefill_chunk,
                  "max_prompt_tokens": 1 if self.max_prompt_tokens is None else self.max_prompt_tokens}
        for name, value in limits.items():
            if value < 1:
                raise DFlashError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        parse_verify(self.verify)
        if not self.directory.is_dir():
            raise DFlashError(f"{self.directory} is not a directory: pass an exported or lowered directory")
        if self.backend is not None:
            from dflash_onnx.targets import get_backend

            get_backend(self.backend)  # an unknown name is refused, naming the known ones
        if self.cost_model is not None and not self.cost_model.is_file():
            raise DFlashError(f"--cost-model {self.cost_model} is not a file: give the JSON cost curve to use")

    def open(self) -> Engine:
        """The engine, its sessions opened (seconds at scale); refused in one line where the directory cannot
        serve with these settings (no tokenizer, a batch the lowering cannot run)."""
        from dflash_onnx.runtime.tokenizer import TextCodec
        from dflash_onnx.targets import open_batch, open_decoder

        self.check()
        codec = TextCodec(self.directory)  # a server speaks text: the directory's tokenizer is needed
        costs = None
        if self.cost_model is not None:  # weighed as given, not corrected by this machine's steps
            from dflash_onnx.runtime.costs import read_costs
            from dflash_onnx.runtime.manifest import load_manifest

            costs = read_costs(self.cost_model, load_manifest(self.directory).verify_rows)
        decoder = open_decoder(self.directory, backend=self.backend, prefill_chunk=self.prefill_chunk,
                               batch_invariant=self.batch_invariant, guess_padding=self.lookup_guess, costs=costs,
                               **self.session_options)
        batch = open_batch(decoder, self.max_batch) if self.max_batch > 1 else None
        if batch is not None and not self.shared_draft:
            batch = replace(batch, drafts=None, unshared_because="--shared-draft off")
        return Engine(decoder, codec, max_queue=self.max_queue, verify=parse_verify(self.verify), batch=batch,
                      max_prompt_tokens=self.max_prompt_tokens)
