"""DFlash training blocks: many anchored blocks of one sequence packed into a single draft forward.

Per sequence, random anchor positions a; each anchor starts a block [token at a, mask x (B-1)] at positions
a..a+B-1. A block sees the target's features at positions strictly before its anchor (what decoding hands
the draft: the anchor token itself was just produced and has no feature yet), attends bidirectionally
inside itself (within the draft layer's causal / sliding rule) and never sees other blocks. Block offset k
predicts the token at a+k; offset 0 carries no loss; offset k weighs exp(-(k-1)/gamma).
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from dflash_onnx.exporter.models.draft import DFlashDraft, visible

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the published recipe's decay per block size


def default_gamma(block_size: int) -> float:
    return GAMMA.get(block_size, max(1.0, block_size / 2.3))


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B-1] weights of offsets 1..B-1 (the proposals 1..B-1 a DFlash draft makes; pass proposals + 1 for a
    draft proposing from its anchor's slot too)."""
    return torch.exp(-(torch.arange(1, block_size, dtype=torch.float32) - 1) / gamma)


def sample_anchors(low: int, high: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` distinct sorted anchors in [low, high]."""
    span = high - low + 1
    if span <= 0:
        return torch.zeros(0, dtype=torch.long)
    picks = torch.randperm(span, generator=generator)[: min(count, span)]
    return torch.sort(picks + low).values


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[K*B] absolute positions of the packed blocks."""
    return (anchors[:, None] + torch.arange(block_size)[None, :]).reshape(-1)


def block_input_ids(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """[K*B]: each block is [token at its anchor, mask x (B-1)]."""
    ids = torch.full((len(anchors), block_size), mask_token_id, dtype=torch.long)
    ids[:, 0] = tokens[anchors]
    return ids.reshape(-1)


def structural_mask(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """[K*B, context_len + K*B]: context keys before the query's anchor; keys of the query's own block."""
    block_of = torch.arange(len(anchors)).repeat_interleave(block_size)
    sees_context = torch.arange(context_len)[None, :] < anchors[block_of][:, None]
    same_block = block_of[:, None] == block_of[None, :]
    return torch.cat([sees_context, same_block], dim=1)


def packed_hidden(draft: DFlashDraft, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                  block_size: int, mask_token_id: int) -> torch.Tensor:
    """[K, B, H] final hidden states of every block, from one forward over the packed blocks (a DFlash2 layer's
    convolutions run within each block).

    features [L, n_taps*H] are the target's tapped hidden states of `tokens` [L].
    """
    context_len = features.shape[0]
    ids = block_input_ids(tokens, anchors, block_size, mask_token_id)[None]
    hidden = F.embedding(ids, draft.embed_tokens) * draft.spec.input_embedding_scale
    context = draft.hidden_norm(draft.fc(features[None]))
    positions = block_positions(anchors, block_size)
    key_positions = torch.cat([torch.arange(context_len), positions])
    cos, sin = draft.rotary_emb(hidden, key_positions[None])
    structure = structural_mask(anchors, block_size, context_len)
    empty = draft.empty_cache(dtype=hidden.dtype)
    for index, layer in enumerate(draft.layers):
        attn = layer.self_attn
        mask = structure & visible(positions[:, None], key_positions[None, :], attn.is_causal, attn.sliding_window)
        hidden, _, _ = layer(hidden, context, cos, sin, empty[2 * index], empty[2 * index + 1], mask[None, None],
                             block_size)
    return draft.norm(hidden)[0].view(len(anchors), block_size, -1)


def next_tokens(tokens: torch.Tensor, anchors: torch.Tensor, count: int) -> torch.Tensor:
    """[K, count]: the `count` tokens after each anchor (what a draft's proposals must be)."""
    return tokens[anchors[:, None] + torch.arange(1, count + 1)[None, :]]


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per offset, weighted and normalized by the weights' sum."""
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none")
    per_token = per_token.view(labels.shape) * weights[None, :]
    return per_token.sum() / (weights.sum() * labels.shape[0])


def acceptance_lengths(proposed: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[K] tokens a step at each anchor would commit: 1 + the leading proposals [K, P] equal to the labels.

    Exact for sequences that are the target's own greedy output (verification would produce `labels`)."""
    return 1 + torch.cumprod((proposed == labels).long(), dim=1).sum(dim=1)


def cosine_with_warmup(step: int, total: int, warmup: int, floor: float = 0.1) -> float:
    """Learning-rate factor: linear warmup, then cosine decay to `floor`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
