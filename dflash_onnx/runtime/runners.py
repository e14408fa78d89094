"""How each graph form is fed: the decoding loop sees only forward/commit and propose.

- concat form (ORT): K/V grow with the context; `present` is past + new, and the committed prefix is
  a zero-copy view fed back as the next past (rollback = a length change).
- buffer form (ORT lowering): the target's session holds [batch, kv_heads, ctx_len, head_dim] buffers
  that GroupQueryAttention updates in place; calls pass the committed length (rollback = a length change).
  The draft's graph returns only its new context rows, which its session writes into its own buffers
  (on the device), or else the runner appends to host buffers.
- retained form (AI 100, CoreML): fixed [batch, kv_heads, ctx_len, head_dim] buffers, writes at positions,
  inputs padded to the compiled specializations. Padded rows sit at the scratch slot ctx_len - 1 (AI 100:
  scatter writes), or continue the call's positions (CoreML: slice writes; the last max-size slots are
  then reserved so a padded call never runs past ctx_len).
  A Session whose `retains_state` is True keeps the buffers on the device; otherwise (ORT emulation)
  each `*_RetainedState` output is fed back as the next input.

Row multiple (concat and buffer forms): ONNX Runtime's CPU matmuls compute a row differently when it is the odd
row out of a call (MLAS runs rows in pairs; a lone row takes a one-row kernel that rounds differently), so a
decode step (1 row) and a verify step (16 rows) can give the same token different logits. With `row_multiple`
2 every call is padded to an even row count (the last row repeated, its id and its position, in the next slots;
its outputs dropped, its K/V overwritten by the next call) and each row's result no longer depends on the call it
is in: greedy and DFlash then produce identical tokens. The lowering measures the multiple
(`Lowering.row_multiple`). A padding row's repeated position tells a mixture-of-experts graph to leave it out of
its experts and give it the result of the row it repeats (passes/experts.py): the padding costs the experts nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.feeds import sampling_feeds
from dflash_onnx.runtime.manifest import GraphSpec, Manifest
from dflash_onnx.runtime.recurrent import RecurrentState
from dflash_onnx.runtime.session import Session


@dataclass
class TargetStep:
    """Per input row: the target's greedy id and the draft's context features; the logits of the rows asked for
    (the last `logits_rows` of the call), None when none were."""

    greedy_ids: np.ndarray
    logits: np.ndarray | None
    context: np.ndarray


@dataclass
class Proposal:
    """The draft's block: its greedy ids, the confidence in each (None when the graph predates
    `draft_confidence`), and its logits when asked for; a DFlash2 draft's selector lattice with them (each
    proposal's candidates [P, k] and their scores after each previous candidate [P, k, k]). A DSpark draft
    called with `sample` returns its drawn chain as ids, and the logits each draw came from; one with a
    confidence head returns the argmax probability of its biased logits beside the head's prediction."""

    ids: np.ndarray
    confidence: np.ndarray | None
    logits: np.ndarray | None
    candidates: np.ndarray | None = None
    candidate_scores: np.ndarray | None = None
    argmax_probability: np.ndarray | None = None

    def signals(self) -> np.ndarray | None:
        """What the verify policy may read per proposal, [signals, P]: the confidence, and the argmax
        probability where the confidence is a head's prediction (dflash_onnx/runtime/policy.py reads the better one)."""
        if self.confidence is None or self.argmax_probability is None:
            return self.confidence
        return np.stack([self.confidence, self.argmax_probability])


class TargetRunner(Protocol):
    """What the decoding loop asks of a target graph, whatever its form (ConcatTarget, BufferTarget, RetainedTarget)."""

    capacity: int | None  # the most positions a request may take; None: no bound

    def forward(self, ids: np.ndarray, logits_rows: int = 0,
                between_chunks: Callable[[], None] | None = None) -> TargetStep:
        """Run `ids` after the committed positions; logits for the last `logits_rows` rows. Where they take more
        than one call (a long prefill), `between_chunks` is called after each call but the last (it may raise to
        stop the prefill, e.g. Cancelled)."""
        ...

    def commit(self, length: int) -> None:
        """Keep the first `length` positions (a rollback is a shorter length)."""
        ...


class DraftRunner(Protocol):
    """What the decoding loop asks of a draft graph, whatever its form (ConcatDraft, RowsDraft, RetainedDraft)."""

    def propose(self, block: np.ndarray, context: np.ndarray, want_logits: bool,
                sample: tuple[np.ndarray, float] | None = None) -> Proposal:
        """Take in the target's `context` rows and draft the block after them."""
        ...


SELECTOR_OUTPUTS = ["candidates", "candidate_scores"]
ARGMAX_PROBABILITY = "draft_argmax_probability"  # beside a confidence head's `draft_confidence`, in every form


def _draft_names(graph: GraphSpec, want_logits: bool) -> list[str]:
    names = graph.output_names()
    confidence = [name for name in ("draft_confidence", ARGMAX_PROBABILITY) if name in names]
    selector = SELECTOR_OUTPUTS if want_logits and SELECTOR_OUTPUTS[-1] in names else []
    return ["draft_ids", *confidence, *(["logits", *selector] if want_logits else [])]


def _proposal(out: dict[str, np.ndarray]) -> Proposal:
    confidence, probability = (out.get(name) for name in ("draft_confidence", ARGMAX_PROBABILITY))
    lattice = [out[name][0] if name in out else None for name in SELECTOR_OUTPUTS]
    return Proposal(out["draft_ids"][0], None if confidence is None else confidence[0].astype(np.float64),
                    out["logits"][0] if "logits" in out else None, *lattice,
                    None if probability is None else probability[0].astype(np.float64))


def _joined(parts: list[np.ndarray]) -> np.ndarray | None:
    return None if not parts else parts[0] if len(parts) == 1 else np.concatenate(parts)


def _wanted_rows(begin: int, end: int, count: int, logits_rows: int) -> slice | None:
    """Which rows of the chunk [begin, end) of a `count`-row call are among its last `logits_rows`."""
    first = count - logits_rows
    return slice(max(0, first - begin), end - begin) if logits_rows > 0 and end > first else None


def _no_rows(heads: int, dim: int) -> tuple[int, ...]:
    """A concat-form K/V input before the first call: [batch 1, no rows, kv_heads, head_dim]."""
    return (1, 0, heads, dim)


class KVState:
    """One graph's K/V: the arrays the last call returned, each paired by name with its input, and the
    committed length. In the concat form (batch 1) `array[:, :length]` is a contiguous view."""

    def __init__(self, graph: GraphSpec, shape: Callable[[int, int], tuple[int, ...]], dtype):
        """`shape(kv_heads, head_dim)`: the initial array's shape for a pair of that size (one zero array per
        distinct shape, shared: the first call replaces them)."""
        if len(graph.kv_inputs) != len(graph.kv_outputs):
            raise DFlashError(f"{graph.file}: {len(graph.kv_inputs)} K/V inputs but {len(graph.kv_outputs)} outputs")
        missing = sorted(set(graph.kv_outputs) - set(graph.output_names()))
        if missing:
            raise DFlashError(f"{graph.file} has no outputs {missing} to pair with its K/V inputs")
        self.inputs, self.outputs = list(graph.kv_inputs), list(graph.kv_outputs)
        zeros = {size: np.zeros(shape(*size), dtype) for size in set(graph.pair_shapes())}
        self.arrays = [zeros[graph.kv_shape(name)] for name in self.inputs]
        self.length = 0

    def prefix_feeds(self) -> dict[str, np.ndarray]:
        return {name: array[:, : self.length] for name, array in zip(self.inputs, self.arrays)}

    def whole_feeds(self) -> dict[str, np.ndarray]:
        return dict(zip(self.inputs, self.arrays))

    def update(self, outputs: dict[str, np.ndarray], length: int) -> None:
        self.arrays = [outputs[name] for name in self.outputs]
        self.length = length


def _padded_rows(ids: np.ndarray, multiple: int) -> np.ndarray:
    """`ids` with its last id repeated up to a multiple of `multiple` rows (see Row multiple above)."""
    extra = -len(ids) % multiple
    return ids if not extra else np.concatenate([ids, np.repeat(ids[-1:], extra)])


def _padded_positions(positions: np.ndarray, padded_rows: int) -> np.ndarray:
    """[1, rows] positions with the last one repeated up to `padded_rows` (see Row multiple above)."""
    extra = padded_rows - positions.shape[1]
    return positions if not extra else np.concatenate([positions, np.repeat(positions[:, -1:], extra, 1)], 1)


class ConcatTarget:
    def __init__(self, session: Session, manifest: Manifest, prefill_chunk: int, row_multiple: int = 1):
        graph = manifest.target
        self.session, self.chunk, self.row_multiple = session, prefill_chunk, row_multiple
        self.kv = KVState(graph, _no_rows, manifest.numpy_dtype)
        # a hybrid target's linear-attention state: fed with every call, committed by rows (recurrent.py)
        self.recurrent = graph.recurrent and RecurrentState(graph.recurrent, manifest.numpy_dtype)
        self.capacity: int | None = None

    def forward(self, ids: np.ndarray, logits_rows: int = 0,
                between_chunks: Callable[[], None] | None = None) -> TargetStep:
        """Run `ids` from the committed length on, with the logits of the last `logits_rows` rows; chunked so
        logits stay [chunk, vocab] at most. Earlier chunks are committed as they go."""
        contexts, greedy, logits = [], [], []
        for begin in range(0, len(ids), self.chunk):
            if begin and between_chunks is not None:
                between_chunks()
            chunk = ids[begin : begin + self.chunk]
            end, rows = begin + len(chunk), len(chunk)
            wanted = _wanted_rows(begin, end, len(ids), logits_rows)
            names = ["greedy_ids", "target_hidden", *self.kv.outputs] + (["logits"] if wanted else [])
            padded = _padded_rows(chunk, self.row_multiple)
            positions = _padded_positions(np.arange(self.kv.length, self.kv.length + rows, dtype=np.int64)[None],
                                          len(padded))
            feeds = {"input_ids": padded[None], "position_ids": positions, **self.kv.prefix_feeds()}
            if self.recurrent:
                feeds.update(self.recurrent.feeds)
                names += self.recurrent.outputs
            out = self.session.run(feeds, names)
            if self.recurrent:
                self.recurrent.record(out, self.kv.length, len(padded))
            self.kv.update(out, self.kv.length if end == len(ids) else self.kv.length + rows)
            if self.recurrent and end < len(ids):
                self.recurrent.commit(self.kv.length)
            contexts.append(out["target_hidden"][0, :rows])
            greedy.append(out["greedy_ids"][0, :rows])
            if wanted:
                logits.append(out["logits"][0, wanted])
        return TargetStep(_joined(greedy), _joined(logits), _joined(contexts))

    def commit(self, length: int) -> None:
        self.kv.length = length
        if self.recurrent:
            self.recurrent.commit(length)


class ConcatDraft:
    def __init__(self, session: Session, manifest: Manifest):
        graph = manifest.draft
        self.session, self.graph = session, graph
        self.kv = KVState(graph, _no_rows, manifest.numpy_dtype)

    def propose(self, block: np.ndarray, context: np.ndarray, want_logits: bool,
                sample: tuple[np.ndarray, float] | None = None) -> Proposal:
        """Append `context` rows to the draft's context cache and draft the block after them; `sample`: a
        DSpark draft's uniforms and temperature, to draw its chain (without: its greedy chain)."""
        start = self.kv.length + len(context)
        positions = np.arange(self.kv.length, start + len(block), dtype=np.int64)[None]
        feeds = {"input_ids": block[None], "target_hidden": context[None], "position_ids": positions,
                 **self.kv.prefix_feeds(), **sampling_feeds(self.graph, *(sample or ()))}
        out = self.session.run(feeds, _draft_names(self.graph, want_logits) + self.kv.outputs)
        self.kv.update(out, start)
        return _proposal(out)


class RowsKV(KVState):
    """A draft's K/V in the ORT lowering's buffer form: its graph returns only the new context rows, which
    `update` appends to preallocated [batch, ctx_len, kv_heads, head_dim] buffers; the filled prefix of each
    is the next call's `past` (a view), so no step copies the cache outside the graph. Context rows never
    roll back."""

    def __init__(self, graph: GraphSpec, capacity: int, dtype):
        super().__init__(graph, lambda heads, dim: (0,), dtype)
        self.arrays = [np.zeros((1, capacity, *graph.kv_shape(name)), dtype) for name in self.inputs]
        self.capacity = capacity

    def update(self, outputs: dict[str, np.ndarray], length: int) -> None:
        if length > self.capacity:
            raise DFlashError(f"the draft's context of {length} rows exceeds the {self.capacity} rows this lowering "
                              "holds: lower again with a larger --ctx-len")
        for array, name in zip(self.arrays, self.outputs):
            array[:, self.length : length] = outputs[name]
        self.length = length


class SessionRowsKV(KVState):
    """A rows-form draft whose session keeps its context rows itself (on the device): nothing is fed back or
    returned; the session reads the past length from the call's first position id."""

    def __init__(self):
        self.inputs, self.outputs, self.arrays, self.length = [], [], [], 0

    def update(self, outputs: dict[str, np.ndarray], length: int) -> None:
        self.length = length


class RowsDraft(ConcatDraft):
    """ConcatDraft over RowsKV: the ORT lowering's draft, whose K/V outputs are the new rows only (kept by
    the session when it retains state, else appended here)."""

    def __init__(self, session: Session, manifest: Manifest):
        self.session, self.graph = session, manifest.draft
        self.kv = SessionRowsKV() if session.retains_state else \
            RowsKV(manifest.draft, int(manifest.ctx_len), manifest.numpy_dtype)


def _pad(rows: np.ndarray, size: int, fill) -> np.ndarray:
    if len(rows) == size:
        return rows
    pad = np.full((size - len(rows), *rows.shape[1:]), fill, dtype=rows.dtype)
    return np.concatenate([rows, pad])


class _Retained:
    """Shared by the retained-form target and draft: buffers, specialization sizes, the scratch slot."""

    def __init__(self, session: Session, manifest: Manifest, graph_name: str):
        graph = getattr(manifest, graph_name)
        self.session, self.graph = session, graph
        self.ctx_len = int(manifest.ctx_len)
        functions = manifest.lowering.functions.get(graph_name) if manifest.lowering is not None else None
        self.sizes = sorted(set(functions["rows"].values()) if functions else
                            {manifest.verify_rows, int(manifest.prefill_len)})
        self.scratch = self.ctx_len - 1
        self.consecutive = manifest.lowering is not None and manifest.lowering.padding == "consecutive"
        # a padded call's slots (consecutive), or the scratch slot and the draft's block past the last token
        # (the draft writes its block's K/V at their positions) stay clear of the committed context
        self.capacity = self.ctx_len - (self.sizes[-1] if self.consecutive else 1 + manifest.block_size)
        self.on_device = session.retains_state
        self.kv = KVState(graph, lambda heads, dim: (1, heads, self.ctx_len, dim), manifest.numpy_dtype)
        lengths = manifest.lowering.compute_context_lengths if manifest.lowering is not None else []
        # the input's length is the read length: one zero array per compiled length, made once
        self.reads = [np.zeros(n, np.int64) for n in sorted(lengths)] if "comp_ctx_lengths" in \
            graph.input_names() else []

    def chunks(self, count: int) -> list[tuple[int, int, int]]:
        """(begin, end, padded size) per call: one call at the smallest size that fits, else prefill_len chunks."""
        fitting = [s for s in self.sizes if s >= count]
        if fitting:
            return [(0, count, fitting[0])]
        big = self.sizes[-1]
        return [(b, min(b + big, count), big) for b in range(0, count, big)]

    def positions(self, start: int, count: int, size: int) -> np.ndarray:
        if start + count > self.capacity:
            raise DFlashError(f"context of {start + count} tokens exceeds the {self.capacity} positions this "
                              f"lowering holds (ctx_len {self.ctx_len}): lower again with a larger --ctx-len")
        if self.consecutive:
            return np.arange(start, start + size, dtype=np.int64)[None]
        return _pad(np.arange(start, start + count, dtype=np.int64), size, self.scratch)[None]

    def read_feed(self, end: int) -> dict[str, np.ndarray]:
        """`comp_ctx_lengths` for a call whose real rows end before position `end` (nothing without CCLs)."""
        if not self.reads:
            return {}
        for read in self.reads:
            if len(read) >= end:
                return {"comp_ctx_lengths": read}
        raise DFlashError(f"context of {end} tokens exceeds the largest compute-context length {len(self.reads[-1])}")

    def run(self, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        if self.on_device:
            return self.session.run(feeds, names)
        out = self.session.run({**feeds, **self.kv.whole_feeds()}, names + self.kv.outputs)
        self.kv.update(out, self.kv.length)
        return out


class RetainedTarget(_Retained):
    def __init__(self, session: Session, manifest: Manifest, row_multiple: int = 1):
        """`row_multiple`: calls run only the functions of at least that many rows (a CoreML lowering's decode
        function is a separately compiled program: greedy steps padded to the verify function give each token
        the same result as in a verify call)."""
        super().__init__(session, manifest, "target")
        self.sizes = [s for s in self.sizes if s >= row_multiple] or self.sizes
        self.length = 0

    def forward(self, ids: np.ndarray, logits_rows: int = 0,
                between_chunks: Callable[[], None] | None = None) -> TargetStep:
        contexts, greedy, logits = [], [], []
        for begin, end, size in self.chunks(len(ids)):
            if begin and between_chunks is not None:
                between_chunks()
            rows = end - begin
            feeds = {"input_ids": _pad(ids[begin:end], size, 0)[None],
                     "position_ids": self.positions(self.length + begin, rows, size),
                     **self.read_feed(self.length + end)}
            wanted = _wanted_rows(begin, end, len(ids), logits_rows)
            out = self.run(feeds, ["greedy_ids", "context_hidden"] + (["logits"] if wanted else []))
            contexts.append(out["context_hidden"][0, :rows])
            greedy.append(out["greedy_ids"][0, :rows])
            if wanted:
                logits.append(out["logits"][0, wanted])
        return TargetStep(_joined(greedy), _joined(logits), _joined(contexts))

    def commit(self, length: int) -> None:
        self.length = length


class RetainedDraft(_Retained):
    def __init__(self, session: Session, manifest: Manifest):
        super().__init__(session, manifest, "draft")
        self.length = 0

    def propose(self, block: np.ndarray, context: np.ndarray, want_logits: bool,
                sample: tuple[np.ndarray, float] | None = None) -> Proposal:
        """As ConcatDraft.propose; the context rows go in as many calls as the specializations need, each drafting
        the block, the last call's proposal kept."""
        start = self.length + len(context)
        block_positions = np.arange(start, start + len(block), dtype=np.int64)[None]  # inside: see capacity
        chain = sampling_feeds(self.graph, *(sample or ()))
        for begin, end, size in self.chunks(len(context)):
            feeds = {"input_ids": block[None], "context_hidden": _pad(context[begin:end], size, 0)[None],
                     "ctx_position_ids": self.positions(self.length + begin, end - begin, size),
                     "position_ids": block_positions, **self.read_feed(start + len(block)), **chain}
            out = self.run(feeds, _draft_names(self.graph, want_logits))
        self.length = start
        return _proposal(out)


class BufferTarget:
    """Buffer form (ORT lowering): the session keeps K/V in preallocated [batch, kv_heads, ctx_len, head_dim]
    buffers that its attention reads and writes in place; each call passes the committed length
    (`seqlens_k` = length after the call - 1, `total_sequence_length`), so rollback is a length change and
    no step copies the cache."""

    NAMES = ["greedy_ids", "target_hidden"]

    def __init__(self, session: Session, manifest: Manifest, prefill_chunk: int, row_multiple: int = 1):
        if not session.retains_state:
            raise DFlashError("buffer-form graphs need a session that keeps their K/V buffers (the ORT lowering's)")
        self.session, self.chunk, self.row_multiple = session, prefill_chunk, row_multiple
        self.capacity = int(manifest.ctx_len) - (row_multiple - 1)  # a padded call's last rows must fit too
        self.length = 0
        # a hybrid target's linear-attention state stays on the host: fed with every call, committed by rows
        self.recurrent = manifest.target.recurrent and RecurrentState(manifest.target.recurrent,
                                                                      manifest.numpy_dtype)
        # every call's position ids are a slice of these, its lengths written into these: a decode step of a
        # small model is a few hundred microseconds, and each numpy allocation is a visible part of it
        self.positions = np.arange(int(manifest.ctx_len), dtype=np.int64)[None]
        self.seqlens, self.total = np.zeros(1, np.int32), np.zeros((), np.int32)

    def _call(self, ids: np.ndarray, start: int, logits: bool) -> dict[str, np.ndarray]:
        """One call on `ids` padded to the row multiple; the caller keeps the first len(ids) rows."""
        if start + len(ids) > self.capacity:
            raise DFlashError(f"a context of {start + len(ids)} tokens exceeds the {self.capacity} positions this "
                              "lowering holds: lower with a larger --ctx-len")
        padded = _padded_rows(ids, self.row_multiple)
        total = start + len(padded)
        self.seqlens[0], self.total[()] = total - 1, total
        positions = _padded_positions(self.positions[:, start : start + len(ids)], len(padded))
        feeds = {"input_ids": padded[None], "position_ids": positions, "seqlens_k": self.seqlens,
                 "total_sequence_length": self.total}
        names = self.NAMES + ["logits"] if logits else self.NAMES
        if not self.recurrent:
            return self.session.run(feeds, names)
        out = self.session.run({**feeds, **self.recurrent.feeds}, names + self.recurrent.outputs)
        self.recurrent.record(out, start, len(padded))
        return out

    def forward(self, ids: np.ndarray, logits_rows: int = 0,
                between_chunks: Callable[[], None] | None = None) -> TargetStep:
        rows = len(ids)
        if rows <= self.chunk:  # every decode and verify step: one call, nothing to join
            out = self._call(ids, self.length, logits_rows > 0)
            logits = out["logits"][0, rows - logits_rows : rows] if logits_rows else None
            return TargetStep(out["greedy_ids"][0, :rows], logits, out["target_hidden"][0, :rows])
        contexts, greedy, logits = [], [], []
        for begin in range(0, len(ids), self.chunk):
            if begin and between_chunks is not None:
                between_chunks()
            chunk = ids[begin : begin + self.chunk]
            wanted = _wanted_rows(begin, begin + len(chunk), len(ids), logits_rows)
            out = self._call(chunk, self.length + begin, wanted is not None)
            if self.recurrent and begin + len(chunk) < len(ids):
                self.recurrent.commit(self.length + begin + len(chunk))
            contexts.append(out["target_hidden"][0, : len(chunk)])
            greedy.append(out["greedy_ids"][0, : len(chunk)])
            if wanted:
                logits.append(out["logits"][0, wanted])
        return TargetStep(_joined(greedy), _joined(logits), _joined(contexts))

    def commit(self, length: int) -> None:
        self.length = length
        if self.recurrent:
            self.recurrent.commit(length)


def open_draft_runner(manifest: Manifest, draft: Session) -> DraftRunner:
    """The draft runner for the manifest's graph form (no target session needed: a check that drafts alone)."""
    if manifest.form == "concat":
        return ConcatDraft(draft, manifest)
    if manifest.form == "buffer":  # the draft's attention is not causal: no GroupQueryAttention buffers for it
        return RowsDraft(draft, manifest) if manifest.draft_returns_rows else ConcatDraft(draft, manifest)
    if manifest.form == "retained":
        return RetainedDraft(draft, manifest)
    raise DFlashError(f"unknown graph form {manifest.form!r} in the manifest")


def open_target_runner(manifest: Manifest, target: Session, prefill_chunk: int,
                       row_multiple: int = 1) -> TargetRunner:
    """The target runner for the manifest's graph form (see open_runners)."""
    if row_multiple < 1:
        raise DFlashError(f"row_multiple must be at least 1, got {row_multiple}")
    if manifest.form == "concat":
        return ConcatTarget(target, manifest, prefill_chunk, row_multiple)
    if manifest.form == "buffer":
        return BufferTarget(target, manifest, prefill_chunk, row_multiple)
    if manifest.form == "retained":
        return RetainedTarget(target, manifest, row_multiple)
    raise DFlashError(f"unknown graph form {manifest.form!r} in the manifest")


def open_runners(manifest: Manifest, target: Session, draft: Session | None, prefill_chunk: int,
                 row_multiple: int = 1) -> tuple[TargetRunner, DraftRunner | None]:
    """The target and draft runners for the manifest's graph form; the target's calls padded to `row_multiple`
    rows (concat and buffer forms; the retained forms pad to their compiled sizes, the smallest at least
    `row_multiple`)."""
    runner = open_target_runner(manifest, target, prefill_chunk, row_multiple)
    return runner, draft and open_draft_runner(manifest, draft)
