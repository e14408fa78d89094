"""What each draft kind is trained on, from the packed blocks' hidden states (dflash_onnx/training/blocks.py).

Every kind: cross-entropy of its proposals' logits against the target's next tokens, each offset weighted
exp(-(k-1)/gamma). What the kinds add, as speculators (vllm-project) trains them:
- DFlash2: the candidate selector's K-way cross-entropy. Each proposal's top-k candidates (the target's token put
  in the last place when the draft's top-k misses it) are scored given the true previous token; the label is the
  target's token among them.
- DSpark: the Markov bias keyed on the true previous token (teacher forcing) is added to the logits the
  cross-entropy sees; the confidence head learns, by binary cross-entropy on its logit, the probability the
  biased draft gives the target's token (its acceptance rate under rejection sampling, speculators' target), or
  with confidence_target "greedy" whether the biased draft's argmax is that token (greedy verification's
  acceptance).
The proposals themselves (for held-out tau) are the chains decoding runs: DFlashDraft.propose.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from dflash_onnx.exporter.models.draft import DFlashDraft
from dflash_onnx.training.blocks import next_tokens, weighted_loss


def proposals(draft: DFlashDraft) -> int:
    return draft.spec.proposals(draft.spec.block_size)


def draft_loss(draft: DFlashDraft, hidden: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
               weights: torch.Tensor, confidence_target: str = "sampled") -> torch.Tensor:
    """The kind's training loss over packed blocks: hidden [K, B, H] of the blocks anchored at `anchors` in
    `tokens`; weights [P], one per proposal; `confidence_target`: what a DSpark confidence head learns (see
    _dspark_loss)."""
    count = proposals(draft)
    first = hidden.shape[1] - count  # the anchor's slot proposes too with sample_from_anchor
    labels = next_tokens(tokens, anchors, count)
    if draft.spec.kind == "dspark":
        return _dspark_loss(draft, hidden, tokens, anchors, labels, first, weights, confidence_target)
    logits = draft.logits(hidden[:, first:])
    loss = weighted_loss(logits, labels, weights)
    if draft.spec.kind == "dflash2":
        previous = torch.cat([tokens[anchors][:, None], labels[:, :-1]], dim=1)
        loss = loss + _selector_loss(draft, logits, hidden[:, first:], previous, labels, weights)
    return loss


def _weighted_mean(per_position: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (per_position * weights[None, :]).sum() / (weights.sum() * per_position.shape[0])


def _selector_loss(draft: DFlashDraft, logits: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor,
                   labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    selector = draft.candidate_selector
    candidates = torch.topk(logits.detach(), selector.top_k, dim=-1).indices  # [K, P, k]
    missing = ~(candidates == labels[..., None]).any(-1)
    candidates[..., -1] = torch.where(missing, labels, candidates[..., -1])
    unary = logits.float().gather(-1, candidates)
    query = selector.hidden_projection(hidden).float()  # [K, P, r]
    before = F.embedding(previous, selector.predecessor_codebook).float()  # [K, P, r]
    after = F.embedding(candidates, selector.successor_codebook).float()  # [K, P, k, r]
    scores = unary + torch.einsum("kpr,kpr,kpcr->kpc", before, query, after)
    target = (candidates == labels[..., None]).float().argmax(-1)
    per_position = F.cross_entropy(scores.reshape(-1, selector.top_k), target.reshape(-1), reduction="none")
    return _weighted_mean(per_position.view(labels.shape), weights)


def _dspark_loss(draft: DFlashDraft, hidden: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                 labels: torch.Tensor, first: int, weights: torch.Tensor, confidence_target: str) -> torch.Tensor:
    """The Markov-biased cross-entropy, plus the confidence head's binary cross-entropy against the acceptance of
    each proposal given the true tokens before it: `sampled`, the probability the biased draft gives the target's
    token (its acceptance rate under rejection sampling against a greedy target, speculators' target); `greedy`,
    1 where the biased draft's argmax is the target's token (what greedy verification accepts, which the verify
    policy of a greedy run weighs)."""
    head = getattr(draft, "markov_head", None)
    rnn = head is not None and head.kind == "rnn"
    body, skipped = (hidden, first) if rnn else (hidden[:, first:], 0)  # an rnn head's state starts at slot 0
    previous, state, biases, codes = tokens[anchors], None, [], []
    for slot in range(body.shape[1] if head is not None else 0):
        bias, code, state = head.step(previous[:, None], body[:, slot : slot + 1], state)
        if slot >= skipped:
            biases.append(bias)
            codes.append(code)
            previous = labels[:, slot - skipped]  # teacher forcing: the next slot follows the true token
    body = body[:, skipped:]
    logits = draft.logits(body)
    if biases:
        logits = logits + torch.cat(biases, 1).to(logits.dtype)
    loss = weighted_loss(logits, labels, weights)
    confidence = getattr(draft, "confidence_head", None)
    if confidence is not None:
        features = torch.cat([body, torch.cat(codes, 1).to(body.dtype)], -1) if draft.spec.confidence_with_markov \
            else body
        if confidence_target == "greedy":
            accepted = (logits.detach().argmax(-1) == labels).float()
        else:
            accepted = torch.softmax(logits.detach().float(), -1).gather(-1, labels[..., None])[..., 0]
        per_position = F.binary_cross_entropy_with_logits(confidence.proj(features)[..., 0].float(), accepted,
                                                          reduction="none")
        loss = loss + _weighted_mean(per_position, weights)
    return loss


def proposed_ids(draft: DFlashDraft, hidden: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """[K, P] the greedy proposals decoding would make from these blocks (each kind's own chain)."""
    return draft.propose(hidden, tokens[anchors])[1]
