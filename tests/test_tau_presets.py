"""The presets at realistic acceptance (dflash_onnx/exporter/tiny.py: qwen3-0.6b-shaped-tau3/5/7 and their small
size, qwen3-0.6b-attention-tau3/5/7): the agree target, which emits only the favourite token, with a draft whose
layer proposes the favourite at the first N = tau - 1 slots of each block and another token after them
(TinySpec.draft_accepts), so that every DFlash step commits N + 1 tokens.

Only the small presets are built here (4 layers of width 256, a second each). The band is tau +-15 %, as the
presets were asked for; what was measured sits well inside it: tau is N + 1 at every step but the last, which the
token budget cuts short, so `bench --max-new-tokens 64` (63 tokens after the first) gave 3.00 / 4.85 / 7.00 at both
160- and 2048-token held-out prompts (docs/benchmarks.md#presets-at-realistic-acceptance), and the 36 tokens decoded
here give 2.92 / 5.00 / 7.00 (35 tokens after the first: 11 x 3 + 2, 7 x 5, 5 x 7)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_onnx.exporter.tiny import PRESETS, build_pair

SMALL = {"qwen3-0.6b-attention-tau3": 3, "qwen3-0.6b-attention-tau5": 5, "qwen3-0.6b-attention-tau7": 7}
BAND = 0.15
NEW_TOKENS = 36


def held_out(target_dir, tokens: int, count: int = 2) -> list[list[int]]:
    """`count` prompts of `tokens` ids of held-out standard-library code, as `bench --prompt-tokens` makes them."""
    from dflash_onnx.bench import depth_prompts
    from dflash_onnx.runtime.tokenizer import TextCodec

    codec = TextCodec(target_dir, artifact=False)
    return [p["ids"] for p in depth_prompts(codec, count, tokens, PRESETS["qwen3-0.6b-attention-agree"].vocab_size)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = build_pair(PRESETS[name], tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def test_the_tau_presets_are_the_agree_pairs_with_a_set_acceptance():
    for size in ("shaped", "attention"):
        agree = PRESETS[f"qwen3-0.6b-{size}-agree"]
        for tau in (3, 5, 7):
            assert PRESETS[f"qwen3-0.6b-{size}-tau{tau}"] == replace(agree, draft_accepts=tau - 1)


def test_draft_accepts_refuses_a_draft_it_cannot_set(tmp_path):
    with pytest.raises(ValueError, match="draft_accepts"):
        build_pair(replace(PRESETS["qwen3-0.6b-attention-tau3"], draft_accepts=15), tmp_path)
    with pytest.raises(ValueError, match="draft_accepts"):
        build_pair(replace(PRESETS["tiny-agree"], draft_accepts=2, agree=False), tmp_path)


def simulated_steps(target_dir, draft_dir, prompts: list[list[int]], new_tokens: int, favourite: int) -> list:
    """Torch, per prompt: the tokens each DFlash step commits, the draft proposing from the whole committed context
    (no cache) and the target keeping the longest agreeing prefix plus one; first checked that the target's greedy
    continuation is `new_tokens` favourites (one forward over the prompt and them: each prediction is the
    favourite, so greedy decoding emits exactly these)."""
    from transformers import AutoModelForCausalLM

    from dflash_onnx.exporter.models.draft import DFlashDraft, DraftSpec

    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    spec = DraftSpec.from_dir(draft_dir)
    draft = DFlashDraft(spec, target.get_input_embeddings().weight, target.get_output_embeddings().weight).eval()
    draft.load_checkpoint(draft_dir)
    mask, block, per_prompt = spec.mask_token_id, spec.block_size, []
    for prompt in prompts:
        full = prompt + [favourite] * new_tokens
        with torch.no_grad():
            out = target(torch.tensor(full)[None], output_hidden_states=True)
            greedy = out.logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
            assert greedy == full[len(prompt):], f"the target's greedy tokens are not all the favourite: {greedy}"
            taps = torch.cat([out.hidden_states[i + 1] for i in spec.target_layer_ids], dim=-1)
            committed, steps = 1, []
            while committed < new_tokens:
                anchor = len(prompt) + committed - 1
                block_ids = torch.tensor([[full[anchor]] + [mask] * (block - 1)])
                proposals = draft(block_ids, taps[:, :anchor], torch.arange(anchor + block)[None],
                                  *draft.empty_cache())[1][0].tolist()
                want, accepted = full[anchor + 1:anchor + block], 0
                while accepted < len(want) and proposals[accepted] == want[accepted]:
                    accepted += 1
                steps.append(min(accepted + 1, new_tokens - committed))
                committed += steps[-1]
        per_prompt.append(steps)
    return per_prompt


@pytest.mark.parametrize("name", list(SMALL))
def test_the_draft_is_accepted_for_a_set_number_of_positions_per_block(built, name):
    """After a held-out prompt of 160 tokens the target emits only the favourite and every step but the last commits
    tau tokens; and after one of 2048 tokens for tau7 (a forward over it costs seconds): the prompt's length does
    not move the acceptance (bench measured all three at both lengths)."""
    tau = SMALL[name]
    target_dir, draft_dir = built(name)
    prompts = [held_out(target_dir, length, count=1)[0] for length in ((160, 2048) if tau == 7 else (160,))]
    for prompt, steps in zip(prompts, simulated_steps(target_dir, draft_dir, prompts, NEW_TOKENS,
                                                      PRESETS[name].favourite_token)):
        assert steps[:-1] == [tau] * (len(steps) - 1) and steps[-1] <= tau, (len(prompt), steps)
        assert abs(sum(steps) / len(steps) - tau) <= BAND * tau, (len(prompt), steps)


def test_dflash_tokens_are_greedy_tokens_at_the_set_tau(built, tmp_path):
    """The exported tau5 pair: DFlash with every block verified gives greedy's tokens on held-out prompts of 160
    tokens, at tau 5 +-15 %."""
    from dflash_onnx.exporter.export import export_pair
    from dflash_onnx.targets import open_decoder

    name = "qwen3-0.6b-attention-tau5"
    target_dir, draft_dir = built(name)
    export_pair(target_dir, draft_dir, tmp_path / "out", progress=False)
    decoder = open_decoder(tmp_path / "out")
    accepted = []
    for prompt in held_out(target_dir, 160):
        greedy = decoder.generate(prompt, NEW_TOKENS, "greedy", stop_token_ids=[]).tokens
        result = decoder.generate(prompt, NEW_TOKENS, "dflash", stop_token_ids=[], verify="full")
        assert result.tokens == greedy
        accepted += result.acceptance_lengths
    assert abs(sum(accepted) / len(accepted) - SMALL[name]) <= BAND * SMALL[name], accepted
