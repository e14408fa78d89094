"""Requests decoded side by side (dflash_onnx/runtime/batching.py over the ragged-attention ORT lowering,
passes/kv_ragged.py):
each request's tokens equal the same request decoded alone, whatever joins or leaves beside it; directories that
cannot batch are refused in one line."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from conftest import CopiedWhenBound
from spread import assert_discriminating, varied_prompts

from dflash_onnx.runtime.batching import BatchParts, SpeculationSwitch, StepBatcher, StepLoop
from dflash_onnx.runtime.decode import Decoder
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.sampling import SamplingParams
from dflash_onnx.runtime.tokenizer import TextCodec
from dflash_onnx.serving.engine import Engine, GenerationRequest, _step_rows
from dflash_onnx.serving.host import EngineSettings
from dflash_onnx.targets import LowerRequest, open_batch, open_decoder
from dflash_onnx.targets.ort.draft_batch import batched_drafts_refusal
from dflash_onnx.targets.ort.lower import lower_ort
from dflash_onnx.targets.ort.options import OrtOptions


@pytest.fixture(scope="module")
def ragged(exported, tmp_path_factory):
    """ragged(name) -> the `lower --target ort --kv-attention ragged` directory of an exported pair."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = tmp_path_factory.mktemp("ragged") / name
            lower_ort(exported(name).out, cache[name], OrtOptions(kv_attention="ragged", ctx_len=256),
                      LowerRequest(progress=False))
        return cache[name]

    return get


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    return varied_prompts(vocab, count, seed, shortest=2, longest=40)


def _alone(decoder: Decoder, prompts: list[list[int]], max_new: int, **kwargs) -> list[list[int]]:
    """Each prompt's greedy tokens decoded alone, first checked to tell the prompts apart (tests/spread.py): an
    isolation test whose requests all expect one output would pass with their K/V mixed."""
    want = [decoder.generate(p, max_new, "greedy", **kwargs).tokens for p in prompts]
    assert_discriminating(prompts, want, lambda p: decoder.generate(p, max_new, "greedy", **kwargs).tokens)
    return want


def _side_by_side(directory, prompts, slots: int, mode: str, max_new: int, sampling=None, prefill_chunk: int = 20,
                  decode=None, prepare=None):
    """Each prompt decoded as a task of one StepLoop on a slot of one batch, a task started as soon as another ends
    (so requests join while others decode and leave before others end); the tokens and the batcher's stats.
    `sampling`: one SamplingParams for all, or a function of the request's index giving its own;
    `decode(index, decoder)`: request `index`'s tokens from its decoder (default: generate in `mode`);
    `prepare(store)`: called on the batch's slot store before any request."""
    base = open_decoder(directory, prefill_chunk=prefill_chunk)
    parts = open_batch(base, slots)
    if prepare:
        prepare(parts.store)
    batcher = StepBatcher(parts.store, big_rows=_step_rows(base), drafts=parts.drafts)
    tokens: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def one(index: int) -> None:
        try:
            slot = batcher.open()
            try:
                params = sampling(index) if callable(sampling) else sampling
                draft = parts.draft_for(slot, params is None or params.greedy)
                decoder = Decoder(base.manifest, slot, draft, prefill_chunk)
                tokens[index] = decode(index, decoder) if decode else \
                    decoder.generate(prompts[index], max_new, mode, params).tokens
            finally:
                slot.release()
        except Exception as exc:  # reported by the test
            errors.append(exc)

    StepLoop(batcher).run([lambda index=index: one(index) for index in range(len(prompts))], slots)
    assert not errors, errors
    return [tokens[i] for i in range(len(prompts))], batcher.stats


@pytest.mark.parametrize("name", ["varied_b4", "varied_moe_b4"])
def test_each_request_decodes_as_it_does_alone(ragged, name):
    """DFlash side by side, 3 slots, 7 requests of 2-39 tokens (prefills chunked at 20 rows: those longer than a
    step run alone beside the batched steps), each expecting its own output: every request's tokens equal its greedy
    decode alone, and calls were really batched."""
    directory = ragged(name)
    alone = open_decoder(directory)
    prompts = _prompts(alone.manifest.vocab_size, 7, seed=1)
    want = _alone(alone, prompts, 24, stop_token_ids=[])
    got, stats = _side_by_side(directory, prompts, 3, "dflash", 24,
                               decode=lambda i, decoder: decoder.generate(prompts[i], 24, "dflash", stop_token_ids=[],
                                                                          verify="full").tokens)
    assert got == want
    assert stats.widest >= 2 and stats.batched_calls > 0 and stats.lone_calls > 0
    if name == "varied_b4":  # a windowed draft: each request drafts on its own
        assert stats.draft_calls == 0
    else:
        assert stats.drafted_requests > stats.draft_calls > 0  # the requests' drafts shared calls too


def _slot_feeds(ids: np.ndarray, starts: list[int]) -> dict[str, np.ndarray]:
    """One batched call's feeds: row r of `ids` continues slot r's context from starts[r]."""
    rows = ids.shape[1]
    lengths = np.array([start + rows - 1 for start in starts], np.int32)
    return {"input_ids": ids, "position_ids": np.stack([np.arange(s, s + rows) for s in starts]),
            "seqlens_k": lengths, "total_sequence_length": np.array(lengths.max() + 1, np.int32)}


def test_a_store_on_a_device_returns_what_a_host_store_returns(ragged):
    """The batch session off the CPU (CUDA, measured on an H200 with benchmarks/batch_check.py) keeps K/V as
    provider values, resized and moved between slots through the host and bound by pointer, and binds its small
    inputs again every call because ORT copies them when they are bound. Simulated on the CPU (copy-on-bind and
    value buffers), a call sequence with repeated shapes, a slot moved when a request leaves, and buffers grown
    past a step returns exactly what the host-array store returns."""
    directory = ragged("llama_sliding_b16")
    rng = np.random.default_rng(5)
    vocab = open_decoder(directory).manifest.vocab_size
    two = [rng.integers(0, vocab, (2, rows)) for rows in (6, 2, 2, 2)]
    one = [rng.integers(0, vocab, (1, rows)) for rows in (2, 70, 2)]

    def calls(store) -> list[np.ndarray]:
        out, starts = [], [0, 0]
        store.active = 2
        for ids in two:  # both slots, the same shape three times running
            out.append(store.run_slots(0, _slot_feeds(ids, starts), ["target_hidden"])["target_hidden"])
            starts = [s + ids.shape[1] for s in starts]
        store.move_slot(1, 0)  # slot 0's request left: slot 1's moves down
        store.active = 1
        for ids in one:  # then past STEP_ROWS rows: the buffers grow
            out.append(store.run_slots(0, _slot_feeds(ids, starts[1:]), ["target_hidden"])["target_hidden"])
            starts[1] += ids.shape[1]
        return out

    host = open_batch(open_decoder(directory), 2).store
    device = open_batch(open_decoder(directory), 2).store
    device._on_device = True
    device._binding = CopiedWhenBound(device._binding, device._graph.kv_inputs)
    for want, got in zip(calls(host), calls(device)):
        np.testing.assert_array_equal(got, want)
    assert isinstance(device._buffers[device._graph.kv_inputs[0]], ort.OrtValue)


class _TruthfulDraft:
    """The real draft session, its proposals replaced by the request's own greedy continuation (known from its
    decode alone): every drafted token is accepted, so each step commits all of its rows."""

    def __init__(self, session, sequence: list[int], block_size: int):
        self.session, self.sequence, self.block = session, sequence, block_size

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run(self, feeds, output_names=None):
        out = dict(self.session.run(feeds, output_names))
        start = int(feeds["position_ids"][0, -self.block])  # the block's first position: the committed length
        ids = [self.sequence[start + offset] if start + offset < len(self.sequence) else 0
               for offset in range(1, self.block)]
        out["draft_ids"] = np.array([ids], dtype=out["draft_ids"].dtype)
        return out


def test_a_hybrid_targets_requests_decode_as_they_do_alone(ragged):
    """A Gated-DeltaNet hybrid's linear-attention state per request: greedy requests beside DFlash ones verifying
    whole blocks (so calls of 2 and 4 rows share steps, and the draft, right in part, leaves different numbers of
    pending rows per request, padded with neutral rows); then DFlash requests whose drafts are always right,
    verifying 1, 2 or 3 tokens, so a request padded by the batch commits all of its own rows (the state after the
    batch's padding is not its own). Every request's tokens equal its greedy decode alone."""
    directory = ragged("hybrid_b4")
    alone = open_decoder(directory)
    prompts = _prompts(alone.manifest.vocab_size, 7, seed=1)
    want = _alone(alone, prompts, 24)
    got, stats = _side_by_side(directory, prompts, 3, "dflash", 24, decode=lambda i, decoder: decoder.generate(
        prompts[i], 24, "greedy" if i % 2 else "dflash", verify="full").tokens)
    assert got == want and stats.padding_rows > 0 and stats.widest == 3
    block = alone.manifest.block_size

    def truthful(index: int, decoder: Decoder) -> list[int]:
        truthful = decoder.sharing(draft=_TruthfulDraft(decoder.draft, prompts[index] + want[index], block))
        result = truthful.generate(prompts[index], 24, "dflash", verify=1 + index % (block - 1))
        assert all(a == min(1 + index % (block - 1), block - 1) + 1 for a in result.acceptance_lengths[:-1])
        return result.tokens

    got, stats = _side_by_side(directory, prompts, 3, "dflash", 24, decode=truthful)
    assert got == want and stats.padding_rows > 0


def test_greedy_and_sampling_side_by_side_are_the_requests_alone(ragged):
    """Greedy side by side equals greedy alone; a seeded sampled request draws the same tokens beside others as
    alone (its logits are the same, bit for bit). Sampled requests verify full blocks here: under `auto` the rows a
    step verifies decide which draws it makes, and the acceptance a decoder has learnt from earlier requests moves
    them (the distribution stays exact; the draws are the same only for the same history)."""
    directory = ragged("varied_moe_b4")
    alone = open_decoder(directory)
    prompts = _prompts(alone.manifest.vocab_size, 5, seed=2)
    got, _ = _side_by_side(directory, prompts, 4, "greedy", 16)
    assert got == _alone(alone, prompts, 16)
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=7)
    mixed = [sampling if index % 2 else SamplingParams(temperature=0.0) for index in range(len(prompts))]
    for params in ([sampling] * len(prompts), mixed):  # mixed: greedy requests share their draft calls while
        # sampled ones draft on their own, in the same steps
        got, stats = _side_by_side(directory, prompts, 4, "dflash", 16, decode=lambda i, decoder, params=params:
                                   decoder.generate(prompts[i], 16, "dflash", params[i], verify="full").tokens)
        assert got == [alone.generate(p, 16, "dflash", s, verify="full").tokens for p, s in zip(prompts, params)]
    assert stats.draft_calls > 0


def test_the_engine_batches_requests_and_their_text_is_solo_greedy(ragged):
    """An engine with 3 slots: 6 requests at once, each text the directory's greedy decode alone; the batcher ran
    steps of several requests."""
    directory = ragged("varied_b4")
    codec, alone = TextCodec(directory), open_decoder(directory)
    stops = set(alone.stop_token_ids)
    prompts = _prompts(alone.manifest.vocab_size, 6, seed=3)
    want = [codec.decode(tokens[:-1] if tokens[-1] in stops else tokens) for tokens in _alone(alone, prompts, 20)]
    decoder = open_decoder(directory)
    engine = Engine(decoder, codec, max_queue=16, batch=open_batch(decoder, 3))
    try:
        submissions = [engine.submit(GenerationRequest(p, 20, SamplingParams(temperature=0.0))) for p in prompts]
        texts = ["".join(event.text for event in submission) for submission in submissions]
    finally:
        engine.close()
    assert texts == want
    assert engine.batcher.stats.widest >= 2 and sum(engine.finished.values()) == 6
    # `serve --shared-draft off` (EngineSettings): a batch whose draft can be shared (varied_b4's is windowed), each
    # request drafting on its own session
    for shared in (True, False):
        opened = EngineSettings(ragged("varied_moe_b4"), max_batch=2, shared_draft=shared).open()
        opened.close()
        assert (opened.batcher.drafts is not None) == shared
        assert opened.drafting == ("one draft call a step" if shared else "a draft call per request "
                                   "(--shared-draft off)")  # what serve's first line says


def test_directories_that_cannot_batch_are_refused_in_one_line(exported, ort_lowered, tmp_path):
    for directory in (exported("agree_b8").out, ort_lowered("agree_b8")):  # an export; the GroupQueryAttention form
        with pytest.raises(DFlashError, match="--kv-attention ragged") as refused:
            open_batch(open_decoder(directory), 2)
        assert "\n" not in str(refused.value)
    with pytest.raises(DFlashError, match="sliding window"):  # ONNX Attention has no window
        lower_ort(exported("causal_gqa4_b4").out, tmp_path / "windowed",
                  OrtOptions(kv_attention="ragged", ctx_len=256), LowerRequest(progress=False))
    assert not (tmp_path / "windowed").exists()
    with pytest.raises(DFlashError, match="drop --kv-buffer off"):
        OrtOptions(kv_attention="ragged", kv_buffer=False).validate(4)
    with pytest.raises(DFlashError, match="choose one of gqa, ragged"):
        OrtOptions(kv_attention="paged").validate(4)


def test_a_slot_that_leaves_hands_its_kv_to_the_last_request(ragged):
    """Slots stay 0..n-1: when slot 0's request leaves, the request in the last slot moves there with its K/V."""
    base = open_decoder(ragged("agree_b8"))
    store = open_batch(base, 3).store
    batcher = StepBatcher(store, big_rows=_step_rows(base))
    first, second, third = batcher.open(), batcher.open(), batcher.open()
    feeds = {"input_ids": np.array([[5, 6]]), "position_ids": np.array([[0, 1]]), "seqlens_k": np.array([1], np.int32),
             "total_sequence_length": np.array(2, np.int32)}
    # calls of 2 rows are small: the three run as one batched call
    StepLoop(batcher).run([lambda slot=slot: slot.run(feeds) for slot in (first, second, third)], 3)
    assert batcher.stats.batched_calls == 1 and batcher.stats.widest == 3
    before = {name: buffer[2].copy() for name, buffer in store.kv_buffers().items()}
    first.release()
    assert (third.slot, second.slot, batcher.active) == (0, 1, 2)
    after = store.kv_buffers()
    assert all(np.array_equal(after[name][0], kept) for name, kept in before.items())


def _draft_feeds(rng, manifest, past: int, rows: int) -> dict[str, np.ndarray]:
    """A rows-form draft call: `rows` new context rows after `past`, then the block."""
    block, features = manifest.block_size, manifest.num_taps * manifest.target_hidden_size
    return {"input_ids": np.full((1, block), manifest.mask_token_id, np.int64),
            "target_hidden": rng.standard_normal((1, rows, features)).astype(np.float32),
            "position_ids": np.arange(past, past + rows + block, dtype=np.int64)[None]}


def test_one_draft_call_for_several_requests_is_each_request_alone(ragged):
    """The ragged lowering's draft run once for several requests (targets/ort/draft_batch.py): each request has its
    own past and new context rows (padded to the call's longest, masked by the graph), over consecutive slots and
    over slots with a gap; each gets the proposals and logits its own draft session gives alone, and the context
    rows written into its slot are the rows its session holds alone; a slot moved keeps its rows."""
    decoder = open_decoder(ragged("agree_b8"))
    manifest, parts = decoder.manifest, open_batch(decoder, 3)
    drafts = parts.drafts
    assert drafts is not None
    rng = np.random.default_rng(11)
    alone = [decoder.draft.fork() for _ in range(3)]
    names = ["draft_ids", "draft_confidence", "logits"]
    pasts = [0, 0, 0]
    for rounds in ([{0: 30, 1: 3, 2: 12}, {0: 1, 1: 9, 2: 4}, {0: 5, 2: 1}, {0: 2, 1: 7, 2: 3}]):
        calls = {slot: (_draft_feeds(rng, manifest, pasts[slot], rows), names) for slot, rows in rounds.items()}
        got = drafts.run_slots(calls, active=3)
        for slot, (feeds, _) in calls.items():
            want = alone[slot].run(feeds, names)
            np.testing.assert_array_equal(got[slot]["draft_ids"], want["draft_ids"])
            np.testing.assert_allclose(got[slot]["logits"], want["logits"], rtol=1e-4, atol=1e-4)
            pasts[slot] += feeds["target_hidden"].shape[1]
    held = drafts.kv_buffers()
    for slot, session in enumerate(alone):
        for name, rows in session.kv_buffers().items():
            np.testing.assert_array_equal(held[name][slot, : pasts[slot]], rows[0, : pasts[slot]])
    drafts.move_slot(2, 0)
    moved = drafts.kv_buffers()
    assert all(np.array_equal(moved[name][0], held[name][2]) for name in held)


def test_the_draft_key_mask_left_unfed_attends_as_before(exported, ragged, tmp_path):
    """The ragged lowering's draft takes each request's row counts (key_mask=1); a call that does not feed them
    (every single-request caller) returns what the GroupQueryAttention lowering's draft, which has no mask,
    returns, bit for bit."""
    masked = open_decoder(ragged("agree_b8"))
    directory = tmp_path / "gqa"
    lower_ort(exported("agree_b8").out, directory, OrtOptions(ctx_len=256), LowerRequest(progress=False))
    plain = open_decoder(directory)
    assert masked.manifest.lowering.rewrites["draft-attention"]["draft"]["key_mask"] is True
    assert "key_mask" not in plain.manifest.lowering.rewrites["draft-attention"]["draft"]
    feeds = _draft_feeds(np.random.default_rng(3), masked.manifest, 0, 21)
    names = ["draft_ids", "logits"]
    got, want = masked.draft.run(feeds, names), plain.draft.run(feeds, names)
    assert all(np.array_equal(got[name], want[name]) for name in names)
    assert "no key mask" in batched_drafts_refusal(plain.manifest, plain.draft)
    assert batched_drafts_refusal(masked.manifest, masked.draft) is None
    windowed = open_decoder(ragged("llama_sliding_b16"))  # its mask is made from key indices, which padding shifts
    assert windowed.manifest.lowering.rewrites["draft-attention"]["draft"]["key_mask"] is False
    assert "a mask of its own" in batched_drafts_refusal(windowed.manifest, windowed.draft)
    assert "a mask of its own" in open_batch(windowed, 2).unshared_because  # the reason reaches serve's first line


def test_ragged_buffers_follow_the_context_in_use(exported, tmp_path):
    """ONNX Attention pays for every buffer row on each call: after a long request the buffers shrink back for a
    short one (alone and in the batch store), in steps of 64 rows, and the short request's tokens are the same
    over either size."""
    directory = tmp_path / "ragged"
    lower_ort(exported("agree_b8").out, directory, OrtOptions(kv_attention="ragged", ctx_len=768),
              LowerRequest(progress=False))
    alone = open_decoder(directory)
    short, long = [5, 6, 7], [int(i % 90) + 1 for i in range(300)]
    first = alone.generate(short, 8, "greedy").tokens
    assert alone.target._rows == 64
    alone.generate(long, 8, "greedy")
    assert alone.target._rows == 320  # 308 rows in steps of 64
    assert alone.generate(short, 8, "greedy").tokens == first and alone.target._rows == 64
    parts = open_batch(alone, 2)
    store, batcher = parts.store, StepBatcher(parts.store, big_rows=_step_rows(alone))
    for prompt, rows in ((long, 320), (short, 64)):
        slot = batcher.open()
        got = Decoder(alone.manifest, slot, parts.own_draft(), 256).generate(prompt, 8, "greedy").tokens
        slot.release()
        assert store._rows == rows
    assert got == first


def test_the_switch_drafts_where_drafting_steps_commit_faster():
    """Each mode's rate is measured on its own steps: the other mode is tried after 8 steps at a width (4 steps),
    then the faster one is kept, per width, and tried again every 64 steps; a width not yet compared follows the
    nearest one that is."""
    switch = SpeculationSwitch()

    def run(width: int, steps: int, drafting_rate: float, greedy_rate: float) -> list[bool]:
        modes = []
        for _ in range(steps):
            mode = switch.drafting
            modes.append(mode)
            switch.observe(width, mode, 100, 100 / (drafting_rate if mode else greedy_rate))
        return modes

    modes = run(8, 20, drafting_rate=1000.0, greedy_rate=1500.0)  # the demo at 8 requests: greedy is faster
    assert modes[:8] == [True] * 8 and modes[8:12] == [False] * 4 and not any(modes[12:])
    assert switch.rates[(8, False)] > switch.rates[(8, True)]
    modes = run(2, 20, drafting_rate=2000.0, greedy_rate=1200.0)  # another width: measured apart
    # until its own probe has measured both modes, a new width runs as the nearest measured width chose (greedy at
    # 8); its probe then finds drafting faster here, and it drafts from then on
    assert modes[:8] == [False] * 8 and modes[8:12] == [True] * 4 and all(modes[12:])
    assert switch.drafting and switch.rates[(2, True)] > switch.rates[(2, False)]
    assert run(3, 1, drafting_rate=2000.0, greedy_rate=1200.0) == [True]  # 3 is nearer 2 than 8
    assert run(5, 1, drafting_rate=2000.0, greedy_rate=1200.0) == [True]  # 5 is as near 2 as 8: the wider decides
    assert not switch.drafting
    switch.observe(8, True, 100, 0.0)  # a step of no measurable time changes nothing
    assert not switch.drafting


def test_a_width_runs_as_the_compared_widths_imply_without_its_first_probe():
    """Drafting gains less the wider the batch: where it lost at 4 requests, 6 run greedy from their first step and
    try drafting only after 64 steps; where it won at 4, 2 draft and try greedy only after 64 steps."""
    for drafting_wins in (False, True):
        switch = SpeculationSwitch()
        rate = {True: 2000.0 if drafting_wins else 1000.0, False: 1500.0}
        for _ in range(20):
            mode = switch.drafting
            switch.observe(4, mode, 100, 100 / rate[mode])
        assert switch.drafting is drafting_wins
        other = 6 if not drafting_wins else 2
        modes = []
        for _ in range(70):
            modes.append(switch.drafting)
            switch.observe(other, modes[-1], 100, 100 / rate[modes[-1]])
        assert modes[:64] == [drafting_wins] * 64 and modes[64] is not drafting_wins


def test_a_mode_that_keeps_losing_is_probed_less_and_less_until_it_wins():
    """Each losing probe doubles the width's wait for the next (64, 128, ... up to 1024 steps): over 2000 greedy-
    faster steps drafting runs the first 8 and 4 per probe, at steps 76, 208, 468 and 984 (a fixed 64-step wait:
    30 probes); once drafting commits faster, its probe wins and the batch drafts from then on."""
    switch = SpeculationSwitch()
    drafting_rate = [1000.0]

    def run(steps: int) -> list[bool]:
        modes = []
        for _ in range(steps):
            modes.append(switch.drafting)
            switch.observe(8, modes[-1], 100, 100 / (drafting_rate[0] if modes[-1] else 1500.0))
        return modes

    modes = run(2000)
    starts = [i for i in range(1, len(modes)) if modes[i] and not modes[i - 1]]
    assert starts == [76, 208, 468, 984] and sum(modes) == 8 + 4 * len(starts)
    drafting_rate[0] = 3000.0  # the text turned easy: drafting now commits faster
    modes = run(2000)
    first = modes.index(True)
    assert first < 1024 and all(modes[first + 4 : first + 60])  # its probe won: the batch drafts from then on


class _CountingStore:
    """A SlotStore that returns zeros and advances a fake clock by `call_s` per call."""

    input_names, output_names = ["input_ids", "position_ids", "seqlens_k", "total_sequence_length"], ["greedy_ids"]

    def __init__(self, slots: int, clock: list[float], call_s: float):
        self.slots, self.active, self.clock, self.call_s = slots, 0, clock, call_s

    def run_slots(self, first, feeds, names):
        self.clock[0] += self.call_s
        return {"greedy_ids": np.zeros(feeds["input_ids"].shape, np.int64)}

    def move_slot(self, source: int, destination: int) -> None:
        pass


def test_the_switch_times_each_step_with_its_own_draft_call(monkeypatch):
    """A step is measured from the end of the batched call before it to the end of its own, once the next call shows
    what it committed: its draft call counts against its own mode (the draft call before the first drafting step
    is not charged to the greedy step before it), and a request that joined since is left out."""
    import dflash_onnx.runtime.batching as batching

    clock = [0.0]
    monkeypatch.setattr(batching.time, "perf_counter", lambda: clock[0])
    batcher = StepBatcher(_CountingStore(4, clock, 0.001), big_rows=2)
    first, second = batcher.open(), batcher.open()
    seen = []
    batcher.switch.observe = lambda width, drafting, tokens, seconds: seen.append((width, drafting, tokens,
                                                                                    round(seconds, 6)))

    def step(lengths: dict, drafting: bool, draft_s: float = 0.0) -> None:
        batcher.switch.drafting = drafting
        clock[0] += draft_s  # the step's draft call and the requests' work, before its target call
        calls = {}
        for session, length in lengths.items():
            feeds = {"input_ids": np.zeros((1, 2), np.int64), "position_ids": np.zeros((1, 2), np.int64),
                     "seqlens_k": np.array([length + 1], np.int32)}
            calls[session.slot] = batching._Call(feeds, ["greedy_ids"])
        batcher._run(calls)

    step({first: 10, second: 20}, False)
    step({first: 11, second: 21}, False, 0.0002)  # greedy: 1 token each
    step({first: 12, second: 22}, True, 0.0005)  # drafting: its draft call 0.5 ms
    step({first: 17, second: 25}, False, 0.0002)
    third = batcher.open()
    step({first: 18, second: 26, third: 5}, False, 0.0002)
    assert seen == [(2, False, 2, 0.0012), (2, True, 8, 0.0015), (2, False, 2, 0.0012)]  # the third left out
    step({first: 19, second: 27, third: 6}, False, 0.0002)
    assert seen[-1] == (3, False, 3, 0.0012)  # now a step of three
    second.release()  # the third moves into the second's slot
    step({first: 21, third: 7}, False, 0.0002)
    assert seen[-1] == (3, False, 4.5, 0.0012)  # the two that stayed, scaled to the step's width of three


def test_a_modes_rate_is_its_recent_steps_tokens_over_their_time():
    """A mode's rate is what its last 16 steps committed over their time: a costly step counts by its time (a
    drafting step that took in a long backlog is drafting's cost), and the oldest steps drop out."""
    switch = SpeculationSwitch()
    for seconds in (0.001, 0.001, 0.010, 0.001, 0.001):
        switch.observe(4, False, 4, seconds)
    assert switch.rates[(4, False)] == pytest.approx(20 / 0.014)
    for _ in range(16):
        switch.observe(4, False, 4, 0.002)
    assert switch.rates[(4, False)] == pytest.approx(2000.0)


def test_a_batch_that_does_not_draft_decodes_greedily(ragged):
    """With the batch's switch on greedy, a DFlash request calls no draft and its tokens are greedy's."""
    directory = ragged("agree_b8")
    decoder = open_decoder(directory)
    prompt = [3, 1, 4, 1, 5]
    want = decoder.generate(prompt, 20, "greedy").tokens
    class GreedyBatch:  # one request, in a batch whose switch chose greedy
        active, drafting = 1, False

    result = decoder.sharing(batch=GreedyBatch()).generate(prompt, 20, "dflash")
    assert result.tokens == want and not any(result.verified)


def test_a_cancelled_request_leaves_the_batch_and_the_others_finish_as_alone(ragged):
    """A request cancelled after its first event stops at its next step and frees its slot; the requests beside it
    and one queued behind it still give their solo greedy text."""
    directory = ragged("varied_b4")
    codec, alone = TextCodec(directory), open_decoder(directory)
    stops = set(alone.stop_token_ids)
    prompts = _prompts(alone.manifest.vocab_size, 4, seed=5)
    want = [codec.decode(tokens[:-1] if tokens[-1] in stops else tokens) for tokens in _alone(alone, prompts[1:], 24)]
    decoder = open_decoder(directory)
    engine = Engine(decoder, codec, max_queue=16, batch=open_batch(decoder, 2))
    try:
        doomed = engine.submit(GenerationRequest(prompts[0], 200, SamplingParams(temperature=0.0)))
        others = [engine.submit(GenerationRequest(p, 24, SamplingParams(temperature=0.0))) for p in prompts[1:]]
        first = doomed.next_event(timeout=60)
        doomed.cancel()
        events = [first] if first.finish else [first, *doomed]  # (a request that ended by itself has no more)
        texts = ["".join(event.text for event in submission) for submission in others]
    finally:
        engine.close()
    assert events[-1].finish == "cancelled" and events[-1].completion_tokens < 200
    assert texts == want and engine.finished["cancelled"] == 1 and engine.batcher.active == 0


def test_a_request_whose_draft_cannot_open_fails_alone(ragged):
    """A draft session that cannot be opened fails its request with the reason; the slot is freed and the next
    request still decodes as alone."""
    directory = ragged("agree_b8")
    codec, alone = TextCodec(directory), open_decoder(directory)
    stops = set(alone.stop_token_ids)
    prompt = _prompts(alone.manifest.vocab_size, 1, seed=9)[0]
    tokens = alone.generate(prompt, 16, "greedy").tokens
    want = codec.decode(tokens[:-1] if tokens[-1] in stops else tokens)
    decoder = open_decoder(directory)
    parts = open_batch(decoder, 2)
    calls = iter([RuntimeError("no memory for a draft session")])

    def flaky_draft():
        failure = next(calls, None)
        if failure is not None:
            raise failure
        return parts.own_draft()

    engine = Engine(decoder, codec, max_queue=16, batch=BatchParts(parts.store, None, flaky_draft))
    try:
        failed = engine.submit(GenerationRequest(prompt, 16, SamplingParams(temperature=0.0))).next_event(timeout=60)
        text = "".join(event.text for event in engine.submit(GenerationRequest(prompt, 16,
                                                                               SamplingParams(temperature=0.0))))
    finally:
        engine.close()
    assert failed.error == "RuntimeError: no memory for a draft session"
    assert text == want and engine.finished["error"] == 1 and engine.batcher.active == 0
