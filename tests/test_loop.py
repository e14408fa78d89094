"""The decoding loop and the runners against scripted fake Sessions: no exported model, no torch, no ONNX.

The fakes (tests/scripted.py) compute a deterministic "model" whose answers depend on every token it is shown,
and a draft that proposes a scripted number of correct tokens, so each test knows the exact tokens, acceptance
lengths and calls a correct loop makes.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import make_manifest
from scripted import (
    BufferTargetSession,
    ConcatTargetSession,
    PositionModel,
    TokenModel,
    fake_sessions,
    reference,
)

from dflash_onnx.runtime.decode import Decoder
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import CostModel, Lowering
from dflash_onnx.runtime.sampling import SamplingParams, sampling_probs

VOCAB = 32  # make_manifest's default; its mask token is 31
PROMPT = [3, 14, 15, 9, 2, 6]
LONG_PROMPT = [5, 1, 30, 2, 8, 13, 21, 4, 17, 0, 11]  # longer than the retained prefill_len below (8)
# form id -> how make_manifest and the fakes are set up for it
FORMS = {
    "concat": {},
    "buffer-rows": {"form": "buffer", "draft_kv": "rows"},
    "buffer-rows-kept": {"form": "buffer", "draft_kv": "rows", "kept_rows": True},
    "buffer-concat-draft": {"form": "buffer", "draft_kv": "concat"},
    "retained": {"form": "retained"},
    "retained-emulated": {"form": "retained", "on_device": False},
    "retained-consecutive": {"form": "retained", "padding": "consecutive"},
}


def scripts(block: int) -> dict[str, list[int]]:
    """Draft scripts: correct proposals per step (then wrong ones); step s uses script[s % len(script)]."""
    return {
        "every length": list(range(block)) + list(range(block - 1, -1, -1)),
        "full blocks": [block - 1],
        "zero acceptance": [0],
        "mixed": [block - 1, 0, block // 2, 1, block - 1, block - 2],
    }


def build(form: str = "concat", block: int = 4, model=None, script=None, prefill_chunk: int = 256,
          stops=(), ctx_len: int = 96, prefill_len: int = 8, confident: bool = False, costs=None,
          proposals: int | None = None):
    """A Decoder over fresh fakes of the form `form` (a FORMS id), and the fakes. With `costs`, the draft graph
    has `draft_confidence` and the manifest that cost curve (the auto verify policy's inputs); `proposals`: a
    draft call's tokens (block_size where the anchor's slot proposes too)."""
    setup = dict(FORMS[form])
    kind = setup.pop("form", "concat")
    on_device = setup.pop("on_device", True)
    kept_rows = setup.pop("kept_rows", False)
    common = {"block_size": block, "stop_token_ids": tuple(stops), "confidence": costs is not None, "costs": costs,
              "proposals": proposals}
    if kind == "concat":
        manifest = make_manifest(**common)
    elif kind == "buffer":
        manifest = make_manifest(**common, form="buffer", ctx_len=ctx_len,
                                 lowering=Lowering(backend="ort", options={}, draft_kv=setup["draft_kv"]))
    else:
        manifest = make_manifest(**common, form="retained", ctx_len=ctx_len, prefill_len=prefill_len,
                                 lowering=Lowering(backend="ai100", options={},
                                                   padding=setup.get("padding", "scratch")))
    pair = fake_sessions(manifest, model or TokenModel(VOCAB), script or [block - 1], on_device, confident,
                         kept_rows)
    # the fakes' calls take no time: the curve given is what the policy weighs
    decoder = Decoder(manifest, pair.target, pair.draft, prefill_chunk, measure_steps=False)
    return decoder, pair


def expected_lengths(budget: int, script: list[int]) -> list[int]:
    """Tokens each step commits with no stop: the script's accepted + 1, cut to what the budget leaves."""
    produced, lengths = 1, []
    while produced < budget:
        correct = script[len(lengths) % len(script)]
        lengths.append(min(correct + 1, budget - produced))
        produced += lengths[-1]
    return lengths


def decode_calls(pair, prompt) -> list:
    """The target's calls after prefill (positions from the prompt's length on)."""
    return [call for call in pair.target.calls if call.past >= len(prompt)]


def draft_steps(pair) -> dict[int, list]:
    """The draft's calls grouped by decode step (a retained draft takes a long context in several calls)."""
    steps: dict[int, list] = {}
    for call in pair.draft.calls:
        steps.setdefault(call.step, []).append(call)
    return steps


def fresh_index_prompt(model, index: int, count: int):
    """A prompt whose greedy continuation's token at `index` occurs there first (so it can be a stop token)."""
    rng = np.random.default_rng(index)
    for _ in range(200):
        prompt = rng.integers(0, VOCAB - 1, size=int(rng.integers(3, 9))).tolist()
        tokens = reference(model, prompt, count)
        if tokens[index] not in tokens[:index]:
            return prompt, tokens
    raise AssertionError("no prompt found")


def never_poison(model, prompt, tokens) -> bool:
    """Every generated token has non-zero probability under the target (none is a rejected draft token)."""
    sequence = list(prompt)
    for token in tokens:
        if token == model.poison(sequence):
            return False
        sequence.append(token)
    return True


# 1. greedy DFlash == plain greedy ------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("script_name", ["every length", "full blocks", "zero acceptance", "mixed"])
def test_greedy_dflash_equals_plain_greedy(block, script_name):
    script = scripts(block)[script_name]
    lengths = [correct + 1 for correct in script * max(2, 12 // len(script))]
    budget = 1 + sum(lengths)  # whole passes over the script: no step cut by the budget
    decoder, pair = build(block=block, script=script)
    result = decoder.generate(PROMPT, budget, "dflash")
    want = reference(TokenModel(VOCAB), PROMPT, budget)
    assert result.tokens == want
    assert result.acceptance_lengths == lengths
    assert result.acceptance_histogram(block) == [lengths.count(n) for n in range(1, block + 1)]
    assert result.tau == pytest.approx(np.mean(lengths))
    assert not result.stopped and result.prompt_tokens == len(PROMPT)
    calls = decode_calls(pair, PROMPT)
    assert len(calls) == len(lengths)  # one verify call per step, and a draft call per step with work for it
    assert len(lengths) - 1 <= len(pair.draft.calls) <= len(lengths)
    produced = 1
    for call, length in zip(calls, lengths):
        if budget - produced >= block:  # whole blocks until the budget's end nears
            assert len(call.ids) == block
        produced += length
    plain = Decoder(pair.manifest, ConcatTargetSession(pair.manifest, TokenModel(VOCAB)), None).generate(
        PROMPT, budget, "greedy")
    assert plain.tokens == want and plain.acceptance_lengths == [1] * (budget - 1)


@pytest.mark.parametrize("form", ["concat", "buffer-rows", "buffer-rows-kept"])
@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.7, seed=5)])
def test_a_draft_proposing_from_its_anchor_slot_verifies_block_size_plus_one(form, sampling):
    """DSpark's anchor slot proposes too: block_size proposals, verified with the anchor in calls of up to
    block_size + 1 tokens, committing up to block_size + 1 per step; the tokens stay greedy's (sampled: the
    sharp model's greedy ones)."""
    block, script = 4, [4, 0, 2, 4, 1, 3]
    lengths = [correct + 1 for correct in script * 2]
    budget = 1 + sum(lengths)
    decoder, pair = build(form, block=block, script=script, proposals=block)
    assert decoder.manifest.verify_rows == block + 1
    result = decoder.generate(PROMPT, budget, "dflash", sampling)
    assert result.tokens == reference(TokenModel(VOCAB), PROMPT, budget)
    assert result.acceptance_lengths == lengths and max(lengths) == block + 1
    assert max(len(call.ids) for call in decode_calls(pair, PROMPT)) == block + 1
    assert all(len(call.block) == block for call in pair.draft.calls)  # the draft's block stays block_size


def test_streamed_chunks_are_the_committed_steps():
    block, script = 4, scripts(4)["mixed"]
    chunks = list(build(block=block, script=script)[0].stream(PROMPT, 20, "dflash"))
    seen = []
    result = build(block=block, script=script)[0].generate(PROMPT, 20, "dflash", on_tokens=seen.append)
    assert [len(c) for c in chunks[1:]] == expected_lengths(20, script) and len(chunks[0]) == 1
    assert seen == chunks
    assert [t for c in chunks for t in c] == reference(TokenModel(VOCAB), PROMPT, 20) == result.tokens


# 2. stop tokens --------------------------------------------------------------------------------------------------

# block 8, script [7, 3, 7]: steps commit token indices 1-8, 9-12 (3 accepted + bonus at 12), 13-20
STOPS = {
    "the first token": (0, []),
    "inside a full block": (5, [5]),
    "inside an accepted run": (10, [8, 2]),
    "the bonus after a rejection": (12, [8, 4]),
    "a full block's bonus": (8, [8]),
}


@pytest.mark.parametrize("where", STOPS)
@pytest.mark.parametrize("via", ["manifest", "argument"])
def test_stop_token_ends_generation_inside_a_step(where, via):
    index, lengths = STOPS[where]
    model = TokenModel(VOCAB)
    prompt, free = fresh_index_prompt(model, index, 30)
    stop = free[index]
    decoder, pair = build(block=8, script=[7, 3, 7], stops=[stop] if via == "manifest" else [])
    result = decoder.generate(prompt, 30, "dflash", stop_token_ids=None if via == "manifest" else [stop])
    assert result.tokens == free[: index + 1] and result.tokens[-1] == stop
    assert result.stopped
    assert result.acceptance_lengths == lengths
    assert len(decode_calls(pair, prompt)) == len(lengths)  # nothing runs after the stop


def test_stop_ids_argument_overrides_the_manifest():
    model = TokenModel(VOCAB)
    prompt, free = fresh_index_prompt(model, 5, 20)
    decoder, _ = build(block=4, stops=[free[5]])
    result = decoder.generate(prompt, 20, "dflash", stop_token_ids=[])
    assert result.tokens == free and not result.stopped


# 3. max_new_tokens -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5, 7, 8, 9, 12, 17, 30])
@pytest.mark.parametrize("script_name", ["full blocks", "mixed"])
def test_budget_gives_exactly_max_new_tokens(block, budget, script_name):
    script = scripts(block)[script_name]
    decoder, pair = build(block=block, script=script)
    result = decoder.generate(PROMPT, budget, "dflash")
    assert len(result.tokens) == budget and not result.stopped
    assert result.tokens == reference(TokenModel(VOCAB), PROMPT, budget)
    lengths = expected_lengths(budget, script)
    assert result.acceptance_lengths == lengths
    calls = decode_calls(pair, PROMPT)
    assert len(calls) == len(lengths)  # no step after the budget is met
    produced = 1
    for call, length in zip(calls, lengths):
        remaining = budget - produced
        # enough rows to commit what the step committed, never more than one past the last kept token
        assert min(block, remaining) <= len(call.ids) <= min(block, remaining + 1), (call.ids, remaining)
        produced += length
    assert max((p for call in calls for p in call.positions), default=0) <= len(PROMPT) + budget - 1


@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("budget", [2, 3, 6, 11])
def test_last_step_verifies_only_rows_whose_tokens_are_kept(block, budget):
    """With r tokens left the step needs r rows (the last token + r - 1 drafts; the bonus is the r-th token):
    a row more only computes a bonus the budget then drops, and with one token left the draft call is wasted."""
    decoder, pair = build(block=block, script=[block - 1])
    result = decoder.generate(PROMPT, budget, "dflash")
    assert len(result.tokens) == budget
    produced, needed_drafts = 1, 0
    for call, length in zip(decode_calls(pair, PROMPT), result.acceptance_lengths):
        remaining = budget - produced
        assert len(call.ids) == min(block, remaining), f"{remaining} token(s) left, verified {len(call.ids)} rows"
        needed_drafts += remaining > 1
        produced += length
    assert len(pair.draft.calls) == needed_drafts


# 4. rollback -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_rollback_feeds_back_exactly_the_committed_prefix(form):
    script = [1, 0, 3, 2, 0, 1]  # partial acceptances: every step leaves rejected rows behind
    decoder, pair = build(form, block=4, script=script)
    result = decoder.generate(LONG_PROMPT, 25, "dflash")
    assert result.tokens == reference(TokenModel(VOCAB), LONG_PROMPT, 25)
    lengths = result.acceptance_lengths
    assert lengths == expected_lengths(25, script)
    committed = LONG_PROMPT + result.tokens
    ends = [len(LONG_PROMPT) + sum(lengths[:i]) for i in range(len(lengths) + 1)]  # committed length per step
    calls = decode_calls(pair, LONG_PROMPT)
    assert len(calls) == len(lengths)
    for call, end in zip(calls, ends):
        assert call.past == end and call.positions[0] == end  # the past K/V is the committed prefix, no more
        assert call.seen == committed[:end]
        assert call.ids[0] == committed[end]  # the block starts with the last committed token
    received = []
    for step, (step_calls, end) in enumerate(zip(draft_steps(pair).values(), ends)):
        assert step_calls[-1].step == step
        before = ends[step - 1] if step else 0
        assert step_calls[0].past == before  # the draft's context cache holds the committed rows only
        positions = [p for call in step_calls for p in call.context_positions]
        assert positions == list(range(before, end))  # exactly the rows committed since its last call
        assert step_calls[-1].block_positions[0] == end and step_calls[-1].block[0] == committed[end]
        received += positions
    assert received == list(range(received[-1] + 1))  # in order, none missing, none twice
    if FORMS[form].get("form") == "retained":
        writes = pair.draft.writes
        assert (writes[: received[-1] + 1] == 1).all() and not writes[received[-1] + 1 :].any()


# 5. sampling -----------------------------------------------------------------------------------------------------

SAMPLINGS = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.7, top_p=0.9, seed=4),
             SamplingParams(temperature=1.3, top_k=5, seed=5)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "t0.7-p0.9", "t1.3-k5"])
def test_sampled_output_is_reproducible_with_a_seed(sampling):
    model, script = PositionModel(VOCAB), scripts(4)["mixed"]
    runs = [build(block=4, model=model, script=script)[0].generate(PROMPT, 40, "dflash", sampling)
            for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and runs[0].acceptance_lengths == runs[1].acceptance_lengths
    assert runs[0].acceptance_lengths == expected_lengths(40, script)  # rejections where the script says
    assert never_poison(model, PROMPT, runs[0].tokens)
    other = build(block=4, model=model, script=script)[0].generate(
        PROMPT, 40, "dflash", SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k, seed=99))
    assert other.tokens != runs[0].tokens


@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "t0.7-p0.9", "t1.3-k5"])
def test_draft_with_the_target_distribution_is_always_accepted(block, sampling):
    """Rejection sampling accepts every proposal when q == p; the committed tokens are the sampled proposals."""
    model = PositionModel(VOCAB, seed=block)
    decoder, pair = build(block=block, model=model, script=[block - 1])
    result = decoder.generate(PROMPT, 41, "dflash", sampling)
    assert result.acceptance_lengths == expected_lengths(41, [block - 1])
    produced = 1
    for call, length in zip(decode_calls(pair, PROMPT), result.acceptance_lengths):
        kept = result.tokens[produced : produced + length]
        assert call.ids[1:length] == kept[: length - 1]  # the sampled drafts, then the bonus
        produced += length
    assert never_poison(model, PROMPT, result.tokens)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_sharp_sampling_reproduces_greedy(form, temperature):
    """A target whose distribution is a point mass: sampled DFlash (rejections included) must give its greedy
    tokens, so the sampled path commits and rolls back like the greedy one."""
    script = scripts(4)["mixed"]
    decoder, _ = build(form, block=4, script=script)
    result = decoder.generate(LONG_PROMPT, 30, "dflash", SamplingParams(temperature=temperature, seed=1))
    assert result.tokens == reference(TokenModel(VOCAB), LONG_PROMPT, 30)
    assert result.acceptance_lengths == expected_lengths(30, script)


@pytest.mark.parametrize("mode", ["dflash", "greedy"])
def test_sampled_tokens_have_the_target_distribution(mode):
    """Lossless sampling: over many seeds, each position's tokens follow the target's distribution there (the
    model's distribution depends on the position only), with a draft whose proposals are accepted with
    probability p < 1, so the prefill draw, accepted drafts, residual resamples and bonuses all count."""
    model, runs, count = PositionModel(VOCAB, seed=12), 1000, 9
    sampling = SamplingParams(temperature=0.8)
    decoder, _ = build(block=4, model=model, script=[0, 1, 2, 3], confident=True)
    results = [decoder.generate(PROMPT, count, mode, SamplingParams(0.8, seed=seed)) for seed in range(runs)]
    tokens = np.array([result.tokens for result in results])
    for index in range(count):
        want = sampling_probs(model.logits(range(len(PROMPT) + index)), sampling)
        distance = 0.5 * np.abs(np.bincount(tokens[:, index], minlength=VOCAB) / runs - want).sum()
        assert distance < 0.1, f"token {index}: total variation {distance:.3f} from the target's distribution"
    if mode == "dflash":
        # the first step's first proposal is the target's likeliest token with q = 1: accepted with probability p,
        # and a rejected one is never resampled (the residual max(0, p - q) is 0 there)
        likeliest = model.greedy(range(len(PROMPT) + 1))
        first_steps = [(result.acceptance_lengths[0], result.tokens[1]) for result in results]
        assert {length > 1 for length, _ in first_steps} == {True, False}
        assert all(token != likeliest for length, token in first_steps if length == 1)


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 11, 22])
def test_sampled_budget_and_stop_cut_the_free_run(budget):
    """Same seed, same draws: a smaller budget or a stop token gives a prefix of the free run (the draft has the
    target's distribution, so every proposal is accepted; a budget's last token may come from another draw)."""
    model, sampling = PositionModel(VOCAB, seed=7), SamplingParams(temperature=0.9, seed=11)
    free = build(block=4, model=model)[0].generate(PROMPT, 40, "dflash", sampling)
    cut = build(block=4, model=model)[0].generate(PROMPT, budget, "dflash", sampling)
    assert len(cut.tokens) == budget and not cut.stopped
    assert cut.tokens[:-1] == free.tokens[: budget - 1] and never_poison(model, PROMPT, cut.tokens)
    index = next(i for i in range(budget - 1, 40) if free.tokens[i] not in free.tokens[:i])
    stop = free.tokens[index]
    stopped = build(block=4, model=model)[0].generate(PROMPT, 40, "dflash", sampling, stop_token_ids=[stop])
    assert stopped.tokens == free.tokens[: index + 1] and stopped.stopped
    assert sum(stopped.acceptance_lengths) == index


def test_one_token_verify_path():
    """mode 'greedy' verifies one token per call and never calls the draft, greedy or sampled."""
    decoder, pair = build(block=4)
    result = decoder.generate(PROMPT, 12, "greedy")
    assert result.tokens == reference(TokenModel(VOCAB), PROMPT, 12) and result.acceptance_lengths == [1] * 11
    assert all(len(call.ids) == 1 for call in decode_calls(pair, PROMPT)) and pair.draft.calls == []
    sharp = decoder.generate(PROMPT, 12, "greedy", SamplingParams(temperature=1.0, seed=0))
    assert sharp.tokens == result.tokens

    model, sampling = PositionModel(VOCAB, seed=2), SamplingParams(temperature=1.0, seed=8)
    runs = [build(block=4, model=model)[0].generate(PROMPT, 30, "greedy", sampling) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 30
    assert runs[0].tokens != reference(model, PROMPT, 30)  # drawn, not the likeliest
    assert never_poison(model, PROMPT, runs[0].tokens)
    index = next(i for i in range(3, 30) if runs[0].tokens[i] not in runs[0].tokens[:i])
    stopped = build(block=4, model=model)[0].generate(PROMPT, 30, "greedy", sampling,
                                                      stop_token_ids=[runs[0].tokens[index]])
    assert stopped.tokens == runs[0].tokens[: index + 1] and stopped.stopped


def test_block_size_one_decodes_without_the_draft():
    decoder, pair = build(block=1)
    result = decoder.generate(PROMPT, 9, "dflash")
    assert result.tokens == reference(TokenModel(VOCAB), PROMPT, 9) and result.acceptance_lengths == [1] * 8
    assert pair.draft.calls == []


# 6. chunked prefill ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["concat", "buffer-rows"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 10, 11, 256])
def test_chunked_prefill_changes_nothing(form, chunk):
    script = scripts(4)["mixed"]
    whole = build(form, block=4, script=script)[0].generate(LONG_PROMPT, 24, "dflash")
    decoder, pair = build(form, block=4, script=script, prefill_chunk=chunk)
    chunked = decoder.generate(LONG_PROMPT, 24, "dflash")
    assert chunked.tokens == whole.tokens == reference(TokenModel(VOCAB), LONG_PROMPT, 24)
    assert chunked.acceptance_lengths == whole.acceptance_lengths
    prefill = [call for call in pair.target.calls if call.past < len(LONG_PROMPT)]
    starts = list(range(0, len(LONG_PROMPT), chunk))
    assert [call.positions for call in prefill] == [list(range(s, min(s + chunk, len(LONG_PROMPT)))) for s in starts]
    assert [call.past for call in prefill] == starts  # each chunk attends to the chunks committed before it
    assert pair.draft.calls[0].context_positions == list(range(len(LONG_PROMPT)))


@pytest.mark.parametrize("form", ["concat", "buffer-rows"])
def test_chunked_prefill_asks_logits_of_the_last_chunk_only(form):
    model, sampling = PositionModel(VOCAB, seed=4), SamplingParams(temperature=1.0, seed=6)
    whole = build(form, block=4, model=model)[0].generate(LONG_PROMPT, 16, "dflash", sampling)
    decoder, pair = build(form, block=4, model=model, prefill_chunk=4)
    chunked = decoder.generate(LONG_PROMPT, 16, "dflash", sampling)
    assert chunked.tokens == whole.tokens
    assert [call.logits for call in pair.target.calls[:3]] == [False, False, True]


@pytest.mark.parametrize("form", ["concat", "buffer-rows"])
def test_sampled_verify_block_longer_than_prefill_chunk(form):
    """prefill_chunk below the block size splits verify blocks too: sampling needs every row's logits."""
    model, sampling = PositionModel(VOCAB, seed=4), SamplingParams(temperature=1.0, seed=6)
    whole = build(form, block=8, model=model, script=[3])[0].generate(PROMPT, 20, "dflash", sampling)
    chunked = build(form, block=8, model=model, script=[3], prefill_chunk=3)[0].generate(
        PROMPT, 20, "dflash", sampling)
    assert chunked.tokens == whole.tokens and chunked.acceptance_lengths == whole.acceptance_lengths


# 7. graph forms --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", [f for f in FORMS if f != "concat"])
def test_forms_give_the_concat_tokens(form):
    script = scripts(4)["mixed"]
    concat = build("concat", block=4, script=script)[0].generate(LONG_PROMPT, 30, "dflash")
    other = build(form, block=4, script=script)[0].generate(LONG_PROMPT, 30, "dflash")
    assert other.tokens == concat.tokens == reference(TokenModel(VOCAB), LONG_PROMPT, 30)
    assert other.acceptance_lengths == concat.acceptance_lengths
    model, sampling = PositionModel(VOCAB, seed=9), SamplingParams(temperature=0.8, top_p=0.95, seed=2)
    concat = build("concat", block=4, model=model, script=script)[0].generate(LONG_PROMPT, 30, "dflash", sampling)
    other = build(form, block=4, model=model, script=script)[0].generate(LONG_PROMPT, 30, "dflash", sampling)
    assert other.tokens == concat.tokens and other.acceptance_lengths == concat.acceptance_lengths


@pytest.mark.parametrize("on_device", [True, False], ids=["on-device", "emulated"])
def test_retained_calls_use_the_specializations_and_the_scratch_slot(on_device):
    decoder, pair = build("retained" if on_device else "retained-emulated", block=4, script=[1, 3, 0],
                          ctx_len=64, prefill_len=8)
    result = decoder.generate(LONG_PROMPT, 20, "dflash")  # the fakes assert padded rows sit at position 63
    assert result.tokens == reference(TokenModel(VOCAB), LONG_PROMPT, 20)
    calls = pair.target.calls
    assert [(c.positions[0], len(c.ids), c.padded_to) for c in calls[:2]] == [(0, 8, 8), (8, 3, 8)]
    assert all(c.padded_to == 4 for c in calls[2:])  # every verify block at the block-size specialization
    first_step = draft_steps(pair)[0]  # 11 context rows: two draft calls, prefill_len rows each
    assert [c.context_positions for c in first_step] == [list(range(8)), list(range(8, 11))]
    decoder, pair = build("retained" if on_device else "retained-emulated", block=4, model=PositionModel(VOCAB),
                          ctx_len=64, prefill_len=8)
    decoder.generate(LONG_PROMPT, 6, "dflash", SamplingParams(temperature=1.0, seed=0))
    assert [c.logits for c in pair.target.calls] == [False, True, True, True]  # not on the first prefill chunk


CAPACITY = {  # form -> positions a ctx_len of 40 holds (block 4, prefill_len 8)
    "buffer-rows": 40,
    "retained": 35,  # ctx_len - 1 - block: the scratch slot, and the draft block written past the last token
    "retained-consecutive": 32,  # ctx_len - prefill_len: a padded call never runs past ctx_len
}


@pytest.mark.parametrize("form", CAPACITY)
def test_capacity_is_checked_before_any_call(form):
    capacity = CAPACITY[form]
    decoder, pair = build(form, block=4, script=[2, 0, 3], ctx_len=40, prefill_len=8)
    with pytest.raises(DFlashError, match="--ctx-len"):
        decoder.generate(PROMPT, capacity - len(PROMPT) + 1, "dflash")
    assert pair.target.calls == [] and pair.draft.calls == []
    result = decoder.generate(PROMPT, capacity - len(PROMPT), "dflash")  # exactly full fits
    assert result.tokens == reference(TokenModel(VOCAB), PROMPT, capacity - len(PROMPT))


def test_buffer_form_refuses_a_session_that_keeps_no_state():
    manifest = make_manifest(form="buffer", ctx_len=32, lowering=Lowering(backend="ort", options={}))
    target = BufferTargetSession(manifest, TokenModel(VOCAB))
    target.retains_state = False
    with pytest.raises(DFlashError, match="keeps their K/V"):
        Decoder(manifest, target, None).generate(PROMPT, 4, "greedy")


# 8. argument errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt,budget,mode,match", [
    ([], 4, "dflash", "empty"),
    (PROMPT, 0, "dflash", "max_new_tokens"),
    (PROMPT, -3, "greedy", "max_new_tokens"),
    (PROMPT, 4, "beam", "mode"),
    ([3, VOCAB], 4, "dflash", "prompt ids"),
    ([-1, 3], 4, "greedy", "prompt ids"),
], ids=["empty prompt", "zero budget", "negative budget", "unknown mode", "id past vocab", "negative id"])
def test_bad_arguments_raise_dflash_error(prompt, budget, mode, match):
    decoder, pair = build()
    with pytest.raises(DFlashError, match=match):
        decoder.generate(prompt, budget, mode)
    with pytest.raises(DFlashError, match=match):
        decoder.stream(prompt, budget, mode)  # when the stream is asked for, not at its first step
    assert pair.target.calls == []


def test_dflash_mode_needs_a_draft():
    manifest = make_manifest()
    decoder = Decoder(manifest, ConcatTargetSession(manifest, TokenModel(VOCAB)), None)
    with pytest.raises(DFlashError, match="draft"):
        decoder.generate(PROMPT, 4, "dflash")
    assert decoder.generate(PROMPT, 4, "greedy").tokens == reference(TokenModel(VOCAB), PROMPT, 4)


def test_bad_decoder_setup_raises_dflash_error():
    manifest = make_manifest()
    target = ConcatTargetSession(manifest, TokenModel(VOCAB))
    with pytest.raises(DFlashError, match="prefill_chunk"):
        Decoder(manifest, target, None, prefill_chunk=0)
    with pytest.raises(DFlashError, match="draft session object does not implement the Session protocol"):
        Decoder(manifest, target, object())
    with pytest.raises(DFlashError, match="form"):
        Decoder(make_manifest(form="ring"), target, None).generate(PROMPT, 4, "greedy")


# --- the auto verify policy inside the loop --------------------------------------------------------------------

STEEP = CostModel(verify_ms=[1.0 + 0.45 * t for t in range(8)], draft_ms=1.0)  # T=8 costs 4.2x T=1
FLAT = CostModel(verify_ms=[1.0] * 8, draft_ms=0.1)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("curve", ["steep", "flat"])
def test_auto_verify_keeps_the_greedy_output(form, curve):
    """Whatever the policy verifies, drafts or skips, the output is the target's greedy output, and the draft
    still sees every committed row once, in order (the fakes assert it on every call)."""
    costs = {"steep": STEEP, "flat": FLAT}[curve]
    decoder, pair = build(form, block=8, script=[0, 1, 7, 2, 0, 0, 5, 7], costs=costs)
    result = decoder.generate(LONG_PROMPT, 40, "dflash", stop_token_ids=[])
    assert result.tokens == reference(TokenModel(VOCAB), LONG_PROMPT, 40)
    assert len(result.verified) == len(result.acceptance_lengths)
    assert len(pair.draft.calls) >= sum(1 for v in result.verified if v)  # a draft may also be verified for 0


def test_auto_skips_the_draft_where_it_cannot_pay_and_keeps_probing():
    """A steep curve and a draft that is never right: after a few steps the loop stops calling the draft (greedy
    steps, one verified row), and still drafts now and then to notice if acceptance rose."""
    decoder, pair = build(block=8, script=[0], costs=STEEP)
    result = decoder.generate(PROMPT, 80, "dflash", stop_token_ids=[])
    assert result.tokens == reference(TokenModel(VOCAB), PROMPT, 80)
    skipped = result.verified.count(0)
    assert skipped > 40 and 0 < len(pair.draft.calls) < 20


def test_the_decoder_measures_its_steps_for_the_policy_across_requests():
    """With step measuring on (the default outside these fakes' tests), a greedy DFlash request's steps feed the
    decoder's Measured: steady steps' times beside the target call and what drafted steps delivered; the next
    request's policy reads the same. Greedy decoding measures nothing, and a sampled request neither reads nor
    feeds it (its verified lengths, which decide its draws, stay independent of timing)."""
    decoder, _ = build(block=8, script=[3], costs=STEEP)
    decoder = decoder.sharing(measure_steps=True)
    measured = decoder.learnt.measured
    decoder.generate(PROMPT, 12, "greedy", stop_token_ids=[])
    assert measured.tokens is None and measured.plain_ms is None
    decoder.generate(PROMPT, 40, "dflash", stop_token_ids=[])
    assert measured.drafted_ms is not None and measured.tokens is not None and measured.scale > 0
    steps = measured.since_draft, measured.tokens, measured.plain_ms
    decoder.generate(PROMPT, 40, "dflash", stop_token_ids=[])
    assert (measured.since_draft, measured.tokens, measured.plain_ms) != steps  # the next request fed the same
    steps = measured.since_draft, measured.tokens, measured.plain_ms, measured.scale
    decoder.generate(PROMPT, 40, "dflash", SamplingParams(temperature=0.8, seed=5), stop_token_ids=[])
    assert (measured.since_draft, measured.tokens, measured.plain_ms, measured.scale) == steps


def test_the_decoder_keeps_what_the_policy_learnt_for_its_next_requests():
    """The same never-right draft: the decoder's second request starts from the calibration the first learnt, so
    it calls the draft less; its tokens stay the target's greedy tokens."""
    decoder, pair = build(block=8, script=[0], costs=STEEP)
    first = decoder.generate(PROMPT, 24, "dflash", stop_token_ids=[])
    first_calls = len(pair.draft.calls)
    second = decoder.generate(PROMPT, 24, "dflash", stop_token_ids=[])
    assert first.tokens == second.tokens == reference(TokenModel(VOCAB), PROMPT, 24)
    assert list(decoder.learnt.calibrations) == [False]  # greedy acceptance only: no sampled request ran
    assert len(pair.draft.calls) - first_calls < first_calls


def test_auto_verifies_whole_blocks_where_they_are_free_and_right():
    decoder, _ = build(block=8, script=[7], costs=FLAT)
    result = decoder.generate(PROMPT, 41, "dflash", stop_token_ids=[])
    assert result.verified[:-1] == [7] * (len(result.verified) - 1) and result.acceptance_lengths[0] == 8


def test_a_request_reprices_its_verify_as_its_context_deepens():
    """A curve flat up to 24 tokens of context and steep from 40 on (as attention at depth makes each verified row
    dear): an always-right draft is verified whole while the request is shallow and not at all once it is deep
    (but for probes), the tokens the target's greedy tokens throughout."""
    flat = {"verify_ms": [1.0] * 8, "draft_ms": 0.1}
    deepening = CostModel(**flat, context=8, deeper=[{"context": 24, **flat}, {
        "context": 40, "verify_ms": [1.0 + 50 * t for t in range(8)], "draft_ms": 5.0}])
    decoder, _ = build(block=8, script=[7], costs=deepening)
    result = decoder.generate(PROMPT, 120, "dflash", stop_token_ids=[])
    assert result.tokens == reference(TokenModel(VOCAB), PROMPT, 120)
    depths = len(PROMPT) + np.cumsum([0, *result.acceptance_lengths[:-1]])  # each step's context
    shallow = [v for v, depth in zip(result.verified, depths) if depth < 24]
    deep = [v for v, depth in zip(result.verified, depths) if depth >= 40]
    assert shallow and set(shallow) == {7}
    assert len(deep) > 40 and deep.count(0) > 0.9 * len(deep)


@pytest.mark.parametrize("verify, expect", [("full", [3, 3, 0]), (2, [2, 2, 2]), (0, [0] * 9)])
def test_fixed_verify_counts(verify, expect):
    decoder, pair = build(block=4, script=[3], costs=STEEP)
    result = decoder.generate(PROMPT, 10, "dflash", stop_token_ids=[], verify=verify)
    assert result.tokens == reference(TokenModel(VOCAB), PROMPT, 10)
    assert result.verified == expect  # the last step keeps one token: nothing left to draft for
    assert (len(pair.draft.calls) == 0) == (verify == 0)


def test_auto_sampling_stays_exact():
    """The policy reads the draft's distributions, never its draws: sampled output keeps the target's
    distribution while the verified length changes from step to step."""
    model, runs, count = PositionModel(VOCAB, seed=5), 600, 7
    sampling = SamplingParams(temperature=0.8)
    decoder, _ = build(block=4, model=model, script=[0, 1, 2, 3], confident=True, costs=STEEP)
    results = [decoder.generate(PROMPT, count, "dflash", SamplingParams(0.8, seed=seed)) for seed in range(runs)]
    assert len({tuple(r.verified) for r in results}) > 1  # the policy did vary what it verified
    tokens = np.array([result.tokens for result in results])
    for index in range(count):
        want = sampling_probs(model.logits(range(len(PROMPT) + index)), sampling)
        distance = 0.5 * np.abs(np.bincount(tokens[:, index], minlength=VOCAB) / runs - want).sum()
        assert distance < 0.12, f"token {index}: total variation {distance:.3f} from the target's distribution"
