"""The packed training blocks follow DFlash's rules and compute exactly what decoding computes."""

from __future__ import annotations

import pytest
import torch

from dflash_onnx.exporter.pair import load_draft, load_target
from dflash_onnx.exporter.tiny import TinySpec, build_pair
from dflash_onnx.training.blocks import (
    acceptance_lengths,
    block_input_ids,
    block_positions,
    cosine_with_warmup,
    loss_weights,
    next_tokens,
    packed_hidden,
    structural_mask,
)
from dflash_onnx.training.objectives import proposed_ids


def test_mask_rules_on_a_small_case():
    anchors, block, context = torch.tensor([2, 5]), 3, 7
    mask = structural_mask(anchors, block, context)
    assert mask.shape == (6, 7 + 6)
    # block 0 (anchor 2): context positions 0, 1 only; its own three block keys; never block 1
    for row in range(3):
        assert mask[row, :7].tolist() == [True, True, False, False, False, False, False]
        assert mask[row, 7:].tolist() == [True, True, True, False, False, False]  # bidirectional inside
    for row in range(3, 6):  # block 1 (anchor 5): context 0..4, its own block
        assert mask[row, :7].tolist() == [True] * 5 + [False] * 2
        assert mask[row, 7:].tolist() == [False, False, False, True, True, True]


def test_blocks_inputs_positions_labels_and_weights():
    tokens = torch.arange(10, 30)
    anchors = torch.tensor([3, 8])
    assert block_input_ids(tokens, anchors, 4, 99).tolist() == [13, 99, 99, 99, 18, 99, 99, 99]
    assert block_positions(anchors, 4).tolist() == [3, 4, 5, 6, 8, 9, 10, 11]
    assert next_tokens(tokens, anchors, 3).tolist() == [[14, 15, 16], [19, 20, 21]]
    weights = loss_weights(16, 7.0)
    assert weights[0] == 1 and torch.isclose(weights[7], torch.exp(torch.tensor(-1.0)))  # offset 8: e^-1
    assert cosine_with_warmup(0, 100, 10) == pytest.approx(0.1) and cosine_with_warmup(100, 100, 10) == 0.1


def test_acceptance_length_counts_the_leading_right_guesses():
    labels = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    guesses = torch.tensor([[1, 2, 3], [1, 0, 3], [0, 2, 3]])
    assert acceptance_lengths(guesses, labels).tolist() == [4, 2, 1]


@pytest.mark.parametrize("name", ["agree_b8", "causal_gqa4_b4", "llama_sliding_b16"])
def test_packed_blocks_equal_one_decoding_step_per_anchor(name, exported):
    """Each packed block's logits == the draft run as in decoding: context = features before the anchor."""
    pair = exported(name)
    lm = load_target(pair.target_dir, "float32")
    draft = load_draft(pair.draft_dir, lm, "float32")
    block, mask_id = pair.spec.block_size, pair.spec.vocab_size - 1
    tokens = torch.randint(2, pair.spec.vocab_size - 1, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = lm(input_ids=tokens[None], output_hidden_states=True).hidden_states
        features = torch.cat([states[i + 1][0] for i in draft.spec.target_layer_ids], dim=-1)
        anchors = torch.tensor([1, 9, 20, 40 - block])
        packed = draft.logits(packed_hidden(draft, features, tokens, anchors, block, mask_id)[:, 1:])
        for k, anchor in enumerate(anchors.tolist()):
            ids = block_input_ids(tokens, anchors[k : k + 1], block, mask_id)[None]
            step = draft(ids, features[None, :anchor], torch.arange(anchor + block)[None], *draft.empty_cache())[0]
            torch.testing.assert_close(packed[k], step[0], atol=2e-5, rtol=1e-4)


def _packed_blocks(spec: TinySpec, tmp_path, length: int, seed: int):
    """A tiny pair's draft, `length` random tokens, the target's tapped features of them, four anchors (the last
    leaving room for a DSpark draft's block_size proposals) and the packed blocks' hidden states."""
    target_dir, draft_dir = build_pair(spec, tmp_path)
    lm = load_target(target_dir, "float32")
    draft = load_draft(draft_dir, lm, "float32")
    tokens = torch.randint(2, spec.vocab_size - 1, (length,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        states = lm(input_ids=tokens[None], output_hidden_states=True).hidden_states
        features = torch.cat([states[i + 1][0] for i in draft.spec.target_layer_ids], dim=-1)
        anchors = torch.tensor([1, 9, 17, length - spec.block_size - 2])
        hidden = packed_hidden(draft, features, tokens, anchors, spec.block_size, spec.vocab_size - 1)
    return draft, tokens, features, anchors, hidden


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_packed_dflash2_and_dspark_blocks_equal_one_decoding_step_per_anchor(kind, tmp_path):
    """DFlash2's convolutions run within each packed block, and DSpark's chain from each block's own anchor:
    the packed blocks' proposals (logits, ids, confidences) == the draft's decoding call at each anchor."""
    spec = TinySpec(draft_kind=kind, draft_format="speculators" if kind == "dspark" else "zlab", block_size=6,
                    target_layer_ids=[0, 2], seed=4)
    draft, tokens, features, anchors, hidden = _packed_blocks(spec, tmp_path, 30, seed=0)
    block, mask_id = spec.block_size, spec.vocab_size - 1
    with torch.no_grad():
        packed = draft.propose(hidden, tokens[anchors])
        assert torch.equal(proposed_ids(draft, hidden, tokens, anchors), packed[1])
        for k, anchor in enumerate(anchors.tolist()):
            ids = block_input_ids(tokens, anchors[k : k + 1], block, mask_id)[None]
            step = draft(ids, features[None, :anchor], torch.arange(anchor + block)[None], *draft.empty_cache())
            torch.testing.assert_close(packed[0][k], step[0][0], atol=2e-5, rtol=1e-4)
            assert packed[1][k].tolist() == step[1][0].tolist()
            torch.testing.assert_close(packed[2][k], step[2][0], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("target", ["sampled", "greedy"])
def test_dspark_confidence_head_learns_the_chosen_acceptance(target, tmp_path):
    """The confidence head's binary cross-entropy pulls its prediction toward each proposal's acceptance: with a
    zero head its bias's gradient is 1/2 minus the weighted mean target, which must be the probability the draft
    gives the target's token (sampled) or the share of greedy proposals equal to it (greedy), computed here from
    the draft's own proposals (a DSpark draft without Markov head: each slot's argmax)."""
    from dflash_onnx.training.objectives import draft_loss

    spec = TinySpec(draft_kind="dspark", draft_format="speculators", block_size=6, target_layer_ids=[0, 2], seed=5,
                    markov_rank=0, confidence_with_markov=False)
    draft, tokens, _, anchors, hidden = _packed_blocks(spec, tmp_path, 40, seed=1)
    with torch.no_grad():
        logits, ids, *_ = draft.propose(hidden, tokens[anchors])
    # the continuation the loss sees: the draft's own proposal at every other slot, so some are accepted
    positions = anchors[:, None] + torch.arange(1, ids.shape[1] + 1)[None, :]
    tokens = tokens.clone()
    tokens[positions[:, ::2]] = ids[:, ::2]
    labels = next_tokens(tokens, anchors, ids.shape[1])
    weights = loss_weights(ids.shape[1] + 1, 4.0)
    head = draft.confidence_head.proj
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
    head.bias.requires_grad_(True)
    draft_loss(draft, hidden, tokens, anchors, weights, target).backward()
    share = (ids == labels).float() if target == "greedy" else \
        torch.softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    expected = 0.5 - (share * weights).sum() / (weights.sum() * share.shape[0])
    torch.testing.assert_close(head.bias.grad[0], expected, atol=1e-6, rtol=1e-5)
    assert 0.5 <= (ids == labels).float().mean() < 1  # accepted and rejected proposals both
