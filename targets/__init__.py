"""Backends, and the registry every command reaches them through.

Each backend package (ort, ai100, mlx, coreml) holds a lowering module (it may import export, passes and
torch) and a session module (numpy plus that backend's runtime library); its `__init__` builds the
`Backend` object registered here. One rule picks a directory's backend when none is named, the same in
every command: the first registered backend that can open it. That is ONNX Runtime for exports and for
ORT and AI 100 lowerings (their graphs are ONNX with weights), and the lowering's own backend for MLX and
CoreML lowerings (their weights and packages only that backend reads).
"""

from __future__ import annotations

import threading
from pathlib import Path

from dflash_onnx.runtime.batching import BatchParts
from dflash_onnx.runtime.decode import Decoder
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import CostModel, Manifest, load_manifest
from dflash_onnx.runtime.session import Session
from dflash_onnx.targets.ai100 import BACKEND as AI100
from dflash_onnx.targets.backend import Backend, Flag, LowerRequest
from dflash_onnx.targets.coreml import BACKEND as COREML
from dflash_onnx.targets.mlx import BACKEND as MLX
from dflash_onnx.targets.ort import BACKEND as ORT
from dflash_onnx.targets.row_invariance import record_row_multiple

BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (ORT, AI100, MLX, COREML)}

__all__ = ["BACKENDS", "Backend", "Flag", "LowerRequest", "backend_for", "get_backend", "open_decoder",
           "open_session", "record_row_multiple"]


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise DFlashError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def backend_for(directory: Path, manifest: Manifest, requested: str | None = None) -> Backend:
    """The backend named (refused with what to do when it cannot open the directory), else the first
    registered backend that can."""
    if requested is not None:
        backend = get_backend(requested)
        reason = backend.can_open(Path(directory), manifest)
        if reason is not None:
            raise DFlashError(reason)
        return backend
    for backend in BACKENDS.values():
        if backend.can_open(Path(directory), manifest) is None:
            return backend
    raise DFlashError(f"{directory} was lowered for {manifest.backend!r}, which this dflash-onnx does not have (it has "
                      f"{', '.join(BACKENDS)}): lower the export again with this version")


def open_session(directory: Path, manifest: Manifest, graph: str, backend: str | None = None,
                 **overrides) -> Session:
    """Open the `graph` ("target" or "draft") of a directory on `backend` (default: the directory's)."""
    if graph not in ("target", "draft"):
        raise ValueError(f"graph must be 'target' or 'draft', not {graph!r}")
    chosen = backend_for(directory, manifest, backend)
    unknown = sorted(set(overrides) - set(chosen.session_options))
    if unknown:
        takes = ", ".join(chosen.session_options) or "none"
        raise DFlashError(f"{chosen.name} sessions take no option {', '.join(unknown)} (they take: {takes})")
    return chosen.open_session(Path(directory), manifest, graph, **overrides)


def open_decoder(directory: Path | str, backend: str | None = None, prefill_chunk: int = 256,
                 batch_invariant: bool = True, guess_padding: bool = True, costs: CostModel | None = None,
                 **overrides) -> Decoder:
    """A Decoder on an exported or lowered directory.

    Args:
        directory: the output of `dflash-onnx export`, `optimize` or `lower`.
        backend: ort, ai100, mlx or coreml (default: the directory's own, as every command picks it).
        prefill_chunk, batch_invariant, guess_padding: see Decoder.
        costs: a cost curve to weigh as given (`dflash_onnx.runtime.costs.read_costs`), not corrected by this
            machine's steps; default: the directory's own, corrected as the steps run.
        overrides: options of the backend's sessions (ORT: intra_op_threads, provider, ...).

    Returns:
        Decoder: both sessions open.

    Raises:
        DFlashError: no dflash.json there, a backend that cannot open the directory, an option it does not take.
    """
    manifest = load_manifest(directory)
    chosen = backend_for(directory, manifest, backend).name
    target = open_session(directory, manifest, "target", chosen, **overrides)
    draft = open_session(directory, manifest, "draft", chosen, **overrides)
    return Decoder(manifest, target, draft, prefill_chunk, costs=costs, measure_steps=costs is None,
                   batch_invariant=batch_invariant, guess_padding=guess_padding)


def open_batch(decoder: Decoder, slots: int) -> BatchParts:
    """For decoding up to `slots` requests side by side on `decoder`'s sessions (dflash_onnx/runtime/batching.py): a
    SlotStore
    over its target session, a DraftStore over its draft where the lowering lets requests share one draft call a
    step (else None), and a function giving a request a draft session of its own (sharing the loaded graph).
    DFlashError in one line where the directory cannot batch."""
    from dflash_onnx.targets.ort.batch_session import OrtBatchSession, batch_refusal
    from dflash_onnx.targets.ort.draft_batch import OrtDraftBatch, batched_drafts_refusal
    from dflash_onnx.targets.ort.session import OrtBufferSession, OrtRowsSession

    refusal = batch_refusal(decoder.manifest)
    if refusal is None and not isinstance(decoder.target, OrtBufferSession):
        refusal = f"batching needs the ORT buffer-form target session, not {type(decoder.target).__name__}"
    if refusal:
        raise DFlashError(refusal)
    store = OrtBatchSession(decoder.target, decoder.manifest, slots)
    draft, turn = decoder.draft, threading.Lock()
    unshared = None if draft is None else batched_drafts_refusal(decoder.manifest, draft)
    drafts = None if draft is None or unshared else OrtDraftBatch(draft, decoder.manifest, slots)

    def own_draft() -> Session | None:
        if draft is None:
            return None
        return _OneAtATime(draft.fork() if isinstance(draft, OrtRowsSession) else draft, turn)

    return BatchParts(store, drafts, own_draft, unshared)


class _OneAtATime:
    """A request's draft session whose calls take turns with the other requests' (one lock): each call gets the
    intra-op threads to itself instead of several calls oversubscribing the cores."""

    def __init__(self, session: Session, turn: threading.Lock):
        self.session, self.turn = session, turn
        self.input_names, self.output_names = session.input_names, session.output_names
        self.retains_state = session.retains_state

    def run(self, feeds, output_names=None):
        with self.turn:
            return self.session.run(feeds, output_names)
