"""Scripted fake Sessions: a deterministic "model" behind every graph form, for unit tests of the decoding loop.

The target is a pure function of the token sequence it is shown. Its K/V rows and context rows record
(position, token), and it rebuilds the sequence from the past it is fed, so a missing, stale or repeated row
changes its answers (or trips an assertion here). The draft proposes a scripted number of the target's own
tokens, then tokens the target never picks (probability 0), so every step's acceptance length is known in
advance, in greedy and in sampled decoding. Every fake records its calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_onnx.runtime.manifest import Manifest

POISON = -1e9  # a logit whose probability is exactly 0 after sampling_probs' max shift (float64 exp)
REAL, BLOCK = 1.0, 2.0  # row flags: a committed context row, a draft block row (must never be fed back)


class TokenModel:
    """Greedy next token hashed from the whole prefix, so any wrong past shows in the output. Its logits are
    sharp (sampling at temperature <= 1 always picks the greedy token) and give `poison` probability 0."""

    def __init__(self, vocab: int, sharp: float = 60.0):
        self.vocab, self.sharp = vocab, sharp
        self._memo: dict[tuple[int, ...], int] = {}

    def greedy(self, prefix) -> int:
        key = tuple(int(t) for t in prefix)
        if key not in self._memo:
            value = 17
            for index, token in enumerate(key):
                value = (value * 131 + token * 7 + index) % 1_000_003
            self._memo[key] = value % self.vocab
        return self._memo[key]

    def poison(self, prefix) -> int:
        return (self.greedy(prefix) + 1) % self.vocab

    def logits(self, prefix) -> np.ndarray:
        row = np.cos(np.arange(self.vocab) * (0.3 + 0.1 * (len(prefix) % 5))).astype(np.float32)
        row[self.greedy(prefix)] = self.sharp
        row[self.poison(prefix)] = POISON
        return row


class PositionModel:
    """Logits that depend on the position only (a fixed random row each), so a draft can give the target's exact
    distribution before the earlier block tokens are sampled (q == p). Not sharp: sampling really samples."""

    def __init__(self, vocab: int, seed: int = 0, positions: int = 1024):
        rows = np.random.default_rng(seed).normal(size=(positions, vocab)).astype(np.float32) * 1.5
        self._poison = (np.arange(positions) * 5 + 3) % vocab
        rows[np.arange(positions), self._poison] = POISON
        self.vocab, self.rows = vocab, rows

    def greedy(self, prefix) -> int:
        return int(np.argmax(self.rows[len(prefix)]))

    def poison(self, prefix) -> int:
        return int(self._poison[len(prefix)])

    def logits(self, prefix) -> np.ndarray:
        return self.rows[len(prefix)]


def confidence(logits: np.ndarray) -> np.ndarray:
    """The probability of each row's argmax, as the exported draft's `draft_confidence` computes it."""
    shifted = np.exp(logits.astype(np.float64) - logits.max(axis=-1, keepdims=True))
    return (shifted.max(axis=-1) / shifted.sum(axis=-1)).astype(np.float32)


def reference(model, prompt, count: int) -> list[int]:
    """Plain greedy decoding of `model`: the tokens every correct loop must produce."""
    sequence = [int(t) for t in prompt]
    for _ in range(count):
        sequence.append(model.greedy(sequence))
    return sequence[len(prompt):]


def hidden_rows(width: int, positions, tokens) -> np.ndarray:
    """Context rows [n, width]: (REAL flag, position, token, 0...)."""
    rows = np.zeros((len(positions), width), np.float32)
    rows[:, 0], rows[:, 1], rows[:, 2] = REAL, positions, tokens
    return rows


def kv_rows(manifest: Manifest, positions, tokens, flag: float = REAL) -> np.ndarray:
    """K/V rows [1, n, kv_heads, head_dim] (concat layout) that record (flag, position, token)."""
    graph = manifest.target
    rows = np.zeros((1, len(positions), graph.num_kv_heads, graph.head_dim), np.float32)
    rows[0, :, :, 0], rows[0, :, :, 1], rows[0, :, :, 2] = flag, np.asarray(positions)[:, None], \
        np.asarray(tokens)[:, None]
    return rows


def past_tokens(past: np.ndarray) -> list[int]:
    """The tokens a concat-layout past records, checking it holds positions 0..n-1 of committed rows only."""
    assert (past[0, :, :, 0] == REAL).all(), "a past row that is not a committed context row was fed back"
    assert (past[0, :, 0, 1] == np.arange(past.shape[1])).all(), f"past positions {past[0, :, 0, 1].tolist()}"
    return past[0, :, 0, 2].astype(np.int64).tolist()


def same_kv(feeds, names) -> np.ndarray:
    """The runners feed every layer's K and V from one call's outputs: here they must all agree."""
    first = feeds[names[0]]
    for name in names[1:]:
        assert np.array_equal(feeds[name], first), f"{name} differs from {names[0]}"
    return first


@dataclass
class TargetCall:
    past: int  # committed rows the call attended to (its first position)
    ids: list[int]  # real (unpadded) input ids
    positions: list[int]
    logits: bool  # logits were asked for
    seen: list[int]  # the tokens at positions 0..past-1 the call attended to
    padded_to: int = 0  # retained form: the specialization size


@dataclass
class DraftCall:
    past: int  # context rows the draft held before this call
    context_positions: list[int]  # positions of the context rows this call received (unpadded)
    block: list[int]
    block_positions: list[int]
    step: int  # decode step this call belongs to


class _Fake:
    """Shared by the fakes: names from the manifest, output selection, call records."""

    retains_state = False

    def __init__(self, manifest: Manifest, model, inputs: list[str], outputs: list[str]):
        self.manifest, self.model = manifest, model
        self.width = manifest.target_hidden_size * manifest.num_taps
        self.input_names, self.output_names = inputs, outputs
        self.calls: list = []

    def _select(self, out: dict, names) -> dict:
        names = self.output_names if names is None else list(names)
        unknown = set(names) - set(self.output_names)
        assert not unknown, f"asked for outputs {sorted(unknown)} this graph does not have"
        return {name: out[name] for name in names}

    def _evaluate(self, history: list[int], ids, positions):
        """Greedy ids, logits and context rows of the rows `ids` at `positions` after `history`."""
        sequence, greedy, logits = list(history), [], []
        for token in ids:
            sequence.append(int(token))
            greedy.append(self.model.greedy(sequence))
            logits.append(self.model.logits(sequence))
        return (np.asarray(greedy, np.int64), np.asarray(logits, np.float32).reshape(len(ids), self.model.vocab),
                hidden_rows(self.width, positions, ids))


class ConcatTargetSession(_Fake):
    """The exported target: past K/V in, past + every new row out; positions must continue the past."""

    def __init__(self, manifest: Manifest, model):
        graph = manifest.target
        super().__init__(manifest, model, graph.input_names(), graph.output_names())

    def run(self, feeds, output_names=None):
        graph = self.manifest.target
        ids, positions = feeds["input_ids"][0], feeds["position_ids"][0]
        if self.retains_state:
            assert not set(graph.kv_inputs) & feeds.keys(), "K/V fed to a session that keeps them"
            past = self.kept[:, : int(positions[0])]
        else:
            past = same_kv(feeds, graph.kv_inputs)
        history = past_tokens(past)
        assert positions.tolist() == list(range(len(history), len(history) + len(ids))), positions.tolist()
        greedy, logits, hidden = self._evaluate(history, ids, positions)
        present = np.concatenate([past, kv_rows(self.manifest, positions, ids)], axis=1)
        names = self.output_names if output_names is None else output_names
        self.calls.append(TargetCall(len(history), ids.tolist(), positions.tolist(), "logits" in names, history))
        out = {"greedy_ids": greedy[None], "logits": logits[None], "target_hidden": hidden[None],
               **{name: present.copy() for name in graph.kv_outputs}}
        return self._select(out, output_names)


class BufferTargetSession(_Fake):
    """The ORT lowering's target: keeps its K/V itself; each call says the length after it (seqlens_k + 1)."""

    retains_state = True

    def __init__(self, manifest: Manifest, model):
        names = ["input_ids", "position_ids", "seqlens_k", "total_sequence_length"]
        super().__init__(manifest, model, names, ["greedy_ids", "target_hidden", "logits"])
        self.tokens = np.full(int(manifest.ctx_len), -1, np.int64)

    def run(self, feeds, output_names=None):
        ids, positions = feeds["input_ids"][0], feeds["position_ids"][0]
        total, seqlens = int(feeds["total_sequence_length"]), int(feeds["seqlens_k"][0])
        assert seqlens == total - 1, (seqlens, total)
        past = total - len(ids)
        assert positions.tolist() == list(range(past, total)), (positions.tolist(), total)
        self.tokens[past:total] = ids
        history = self.tokens[:past].tolist()
        assert min(history, default=0) >= 0, "a row before the call's first position was never written"
        greedy, logits, hidden = self._evaluate(history, ids, positions)
        names = self.output_names if output_names is None else output_names
        self.calls.append(TargetCall(past, ids.tolist(), positions.tolist(), "logits" in names, history))
        return self._select({"greedy_ids": greedy[None], "logits": logits[None], "target_hidden": hidden[None]},
                            output_names)


class _RetainedState:
    """Retained form: a [1, kv_heads, ctx_len, head_dim] buffer of (flag, position, token) rows written at the
    given positions, held by the session (on device) or fed in and returned whole (ORT emulation)."""

    def _setup_retained(self, manifest: Manifest, graph, on_device: bool):
        self.retains_state = on_device
        self.ctx_len = int(manifest.ctx_len)
        self.scratch = self.ctx_len - 1
        self.sizes = {manifest.block_size, int(manifest.prefill_len)}
        self.consecutive = manifest.lowering is not None and manifest.lowering.padding == "consecutive"
        self.state = np.zeros((1, graph.num_kv_heads, self.ctx_len, graph.head_dim), np.float32)

    def _state(self, feeds, graph) -> np.ndarray:
        return self.state if self.retains_state else same_kv(feeds, graph.kv_inputs).copy()

    def _check_padding(self, positions: np.ndarray, real: int) -> None:
        """Padded rows sit at the scratch slot (or continue the positions, consecutive padding)."""
        start = int(positions[0])
        want = list(range(start, start + (len(positions) if self.consecutive else real)))
        want += [] if self.consecutive else [self.scratch] * (len(positions) - real)
        assert positions.tolist() == want, (positions.tolist(), want)

    @staticmethod
    def _known(state: np.ndarray, end: int) -> list[int] | None:
        """Tokens at positions 0..end-1, or None when one of them was never written."""
        if not (state[0, 0, :end, 0] == REAL).all():
            return None
        return state[0, 0, :end, 2].astype(np.int64).tolist()


class RetainedTargetSession(_Fake, _RetainedState):
    """The AI 100 / CoreML target: fixed-size calls (block_size or prefill_len), writes at position_ids."""

    def __init__(self, manifest: Manifest, model, on_device: bool = True):
        graph = manifest.target
        super().__init__(manifest, model, ["input_ids", "position_ids", *graph.kv_inputs],
                         ["greedy_ids", "context_hidden", "logits", *graph.kv_outputs])
        self._setup_retained(manifest, graph, on_device)

    def run(self, feeds, output_names=None):
        graph = self.manifest.target
        ids, positions = feeds["input_ids"][0], feeds["position_ids"][0]
        size = len(ids)
        assert size in self.sizes and positions.shape == ids.shape, (size, self.sizes)
        real = size if self.consecutive else int((positions != self.scratch).sum())
        self._check_padding(positions, real)
        state = self._state(feeds, graph)
        state[0, :, positions, 0], state[0, :, positions, 1] = REAL, positions[:, None]
        state[0, :, positions, 2] = ids[:, None]
        history = self._known(state, int(positions[0]))
        assert history is not None, "a row before the call's first position was never written"
        greedy, logits, hidden = self._evaluate(history, ids[:real], positions[:real])
        pad = size - real  # what a real graph returns on padded rows is garbage: make it conspicuous
        greedy = np.concatenate([greedy, np.full(pad, -1, np.int64)])
        logits = np.concatenate([logits, np.full((pad, self.model.vocab), np.nan, np.float32)])
        hidden = np.concatenate([hidden, np.full((pad, self.width), np.nan, np.float32)])
        names = self.output_names if output_names is None else output_names
        self.calls.append(TargetCall(int(positions[0]), ids[:real].tolist(), positions[:real].tolist(),
                                     "logits" in names, history, size))
        out = {"greedy_ids": greedy[None], "logits": logits[None], "context_hidden": hidden[None],
               **{name: state.copy() for name in graph.kv_outputs}}
        return self._select(out, output_names)


class _Proposer:
    """The draft's script: at decode step s it proposes script[s % len(script)] of the target's own tokens,
    then tokens the target never picks. Its logits reproduce the target's for the correct ones (q == p) and are
    one-hot on the wrong ones (q = 1 where p = 0), so sampled decoding follows the same script.
    `confident`: the rows after the correct ones are one-hot on the target's greedy token instead (q = 1 where
    0 < p < 1), so sampled decoding accepts them with probability p: rejections are random."""

    def _setup_proposer(self, manifest: Manifest, script, confident: bool = False):
        self.block_size, self.mask_id = manifest.block_size, manifest.mask_token_id
        self.proposing = manifest.verify_rows - 1  # block_size - 1, or block_size where the anchor slot proposes
        self.confident = confident
        self.script = list(script)
        assert all(0 <= k <= self.proposing for k in self.script), self.script
        self.steps = 0
        self.proposals: list[list[int]] = []

    def _propose(self, sequence: list[int]):
        correct = self.script[self.steps % len(self.script)]
        prefix, ids, logits = list(sequence), [], []
        for index in range(self.proposing):
            if index < correct:
                token, row = self.model.greedy(prefix), np.array(self.model.logits(prefix), np.float32)
            else:
                token = self.model.greedy(prefix) if self.confident else self.model.poison(prefix)
                row = np.full(self.model.vocab, POISON, np.float32)
                row[token] = 0.0
            ids.append(token)
            logits.append(row)
            prefix.append(token)
        self.proposals.append(ids)
        self.steps += 1
        return np.asarray(ids, np.int64)[None], np.asarray(logits, np.float32).reshape(1, -1, self.model.vocab)

    def _check_block(self, block: np.ndarray) -> None:
        assert len(block) == self.block_size and (block[1:] == self.mask_id).all(), block.tolist()


class ConcatDraftSession(_Fake, _Proposer):
    """The exported draft (past + context rows + block rows out) or, with `rows`, the ORT lowering's draft whose
    K/V outputs are the new context rows only. The block rows it appends must never come back as past."""

    def __init__(self, manifest: Manifest, model, script, rows: bool = False, confident: bool = False,
                 kept: bool = False):
        graph = manifest.draft
        super().__init__(manifest, model, graph.input_names(), graph.output_names())
        self._setup_proposer(manifest, script, confident)
        self.rows = rows
        # kept: the rows session of the ORT lowering (OrtRowsSession) holds the rows; past = first position
        self.retains_state = kept
        self.kept = np.zeros((1, int(manifest.ctx_len or 0), graph.num_kv_heads, graph.head_dim), np.float32)

    def run(self, feeds, output_names=None):
        graph = self.manifest.draft
        block, context, positions = feeds["input_ids"][0], feeds["target_hidden"][0], feeds["position_ids"][0]
        self._check_block(block)
        if self.retains_state:
            assert not set(graph.kv_inputs) & feeds.keys(), "K/V fed to a session that keeps them"
            past = self.kept[:, : int(positions[0])]
        else:
            past = same_kv(feeds, graph.kv_inputs)
        history = past_tokens(past)
        assert (context[:, 0] == REAL).all(), "a context row that is not one of the target's rows"
        context_positions = context[:, 1].astype(np.int64).tolist()
        context_tokens = context[:, 2].astype(np.int64).tolist()
        start = len(history) + len(context)
        assert positions.tolist() == list(range(len(history), start + len(block))), positions.tolist()
        assert context_positions == positions[: len(context)].tolist(), (context_positions, positions.tolist())
        self.calls.append(DraftCall(len(history), context_positions, block.tolist(),
                                    positions[len(context):].tolist(), self.steps))
        ids, logits = self._propose(history + context_tokens + [int(block[0])])
        new = kv_rows(self.manifest, context_positions, context_tokens)
        block_rows = kv_rows(self.manifest, positions[len(context):], block, flag=BLOCK)
        if self.retains_state:
            self.kept[:, len(history) : start] = new
            out = {"draft_ids": ids, "logits": logits, "draft_confidence": confidence(logits)}
            return self._select(out, [n for n in output_names or out if n not in graph.kv_outputs])
        present = new if self.rows else np.concatenate([past, new, block_rows], axis=1)
        out = {"draft_ids": ids, "logits": logits, "draft_confidence": confidence(logits),
               **{name: present.copy() for name in graph.kv_outputs}}
        return self._select(out, output_names)


class RetainedDraftSession(_Fake, _RetainedState, _Proposer):
    """The AI 100 / CoreML draft: context rows (padded) written at ctx_position_ids, the block at position_ids.
    A call whose context does not yet reach the block (an earlier chunk of a long context) answers garbage."""

    def __init__(self, manifest: Manifest, model, script, on_device: bool = True, confident: bool = False):
        graph = manifest.draft
        confidence = ["draft_confidence"] if "draft_confidence" in graph.output_names() else []
        super().__init__(manifest, model, ["input_ids", "context_hidden", "ctx_position_ids", "position_ids",
                                           *graph.kv_inputs], ["draft_ids", *confidence, "logits", *graph.kv_outputs])
        self._setup_retained(manifest, graph, on_device)
        self._setup_proposer(manifest, script, confident)
        self.writes = np.zeros(self.ctx_len, np.int64)  # real context rows written per position

    def run(self, feeds, output_names=None):
        graph = self.manifest.draft
        block, context = feeds["input_ids"][0], feeds["context_hidden"][0]
        context_positions, positions = feeds["ctx_position_ids"][0], feeds["position_ids"][0]
        self._check_block(block)
        assert len(context) in self.sizes and context_positions.shape == (len(context),), len(context)
        real = int((context[:, 0] == REAL).sum())
        assert (context[:real, 0] == REAL).all() and not (context[real:] != 0).any(), "padding inside the rows"
        assert (context[:real, 1] == context_positions[:real]).all(), "context rows fed at other positions"
        self._check_padding(context_positions, real)
        state = self._state(feeds, graph)
        past = int(self.writes.astype(bool).sum())
        state[0, :, context_positions, :3] = 0.0
        state[0, :, context_positions[:real], 0] = REAL
        state[0, :, context_positions[:real], 1] = context_positions[:real, None]
        state[0, :, context_positions[:real], 2] = context[:real, 2][:, None]
        self.writes[context_positions[:real]] += 1
        start = int(positions[0])
        assert positions.tolist() == list(range(start, start + len(block))), positions.tolist()
        known = self._known(state, start)
        self.calls.append(DraftCall(past, context_positions[:real].tolist(), block.tolist(), positions.tolist(),
                                    self.steps))
        if known is None:
            ids = np.full((1, self.block_size - 1), -1, np.int64)
            logits = np.full((1, self.block_size - 1, self.model.vocab), np.nan, np.float32)
        else:
            ids, logits = self._propose(known + [int(block[0])])
        return self._select({"draft_ids": ids, "logits": logits, "draft_confidence": confidence(logits),
                             **{name: state.copy() for name in graph.kv_outputs}}, output_names)


@dataclass
class Pair:
    """A manifest with its two fake sessions."""

    manifest: Manifest
    target: _Fake
    draft: _Fake | None


def fake_sessions(manifest: Manifest, model, script, on_device: bool = True, confident: bool = False,
                  kept_rows: bool = False) -> Pair:
    """The fakes that the runners of `manifest`'s form expect."""
    if manifest.form == "concat":
        return Pair(manifest, ConcatTargetSession(manifest, model),
                    ConcatDraftSession(manifest, model, script, confident=confident))
    if manifest.form == "buffer":
        rows = manifest.draft_returns_rows
        return Pair(manifest, BufferTargetSession(manifest, model),
                    ConcatDraftSession(manifest, model, script, rows=rows, confident=confident,
                                       kept=rows and kept_rows))
    if manifest.form == "retained":
        return Pair(manifest, RetainedTargetSession(manifest, model, on_device),
                    RetainedDraftSession(manifest, model, script, on_device, confident=confident))
    raise ValueError(manifest.form)
