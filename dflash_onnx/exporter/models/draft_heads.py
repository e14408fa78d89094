"""What DFlash2 and DSpark add to the DFlash draft, in PyTorch for export (the math of the published models, the
tensor names their checkpoints ship):

- DFlash2: a grouped, token-conditioned causal convolution around each layer's attention and MLP
  (`attention_conv`, `mlp_conv`), and a candidate selector that re-scores each position's top-k by a low-rank
  pairwise term keyed on the previous token (`candidate_selector`);
- DSpark: a low-rank Markov logit bias keyed on the previous token (`markov_head`: vanilla, gated or rnn) and a
  confidence head predicting each position's acceptance (`confidence_head`).

Greedy chains (previous token -> next) are unrolled over the block, which the export specializes, so a greedy
step still pulls only ids and confidences from the graph.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class GroupedDynamicCausalConv(nn.Module):
    """Per channel c and output slot t: sum over taps of x[t - tap, c] * (base[tap, c] + delta[t, tap, c // group]),
    zero before the block's first slot. `prepare` convolves a sublayer's input and returns the deltas its output
    side uses (computed from the same input); `finish` convolves the sublayer's output with them."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """x [batch, slots, hidden], delta [batch, slots, taps, groups], base [taps, hidden]."""
        coefficient = base.to(x.dtype) + delta.repeat_interleave(self.group_size, dim=-1)  # [b, slots, taps, hidden]
        out = x * coefficient[:, :, 0]
        for tap in range(1, self.kernel_size):
            shifted = F.pad(x[:, :-tap], (0, 0, tap, 0)) if tap < x.shape[1] else torch.zeros_like(x)
            out = out + shifted * coefficient[:, :, tap]
        return out

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self(x)

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self(y, delta)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None):
        """`prepare` without `delta`, `finish` with it: both pass through the module's call, so weights loaded
        per call (dflash_onnx/exporter/lazy_weights.py) are there."""
        if delta is not None:
            return self._convolve(x, delta, self.base_kernel[1])
        delta = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.groups))
        return self._convolve(x, delta[..., 0, :, :], self.base_kernel[0]), delta[..., 1, :, :]


class CandidateSelector(nn.Module):
    """Scores of position j's top-k candidates c given the previous token a:
    logits_j[c] + sum_r P[a, r] * (W h_j)_r * S[c, r]."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def lattice(self, logits: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor):
        """forward(), through the module's call (weights loaded per call are there)."""
        return self(logits, hidden, anchor)

    def forward(self, logits: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor):
        """For positions j of logits [b, P, V] and hidden [b, P, H]: the candidates [b, P, k] and every
        (previous candidate i, candidate c) score [b, P, k, k] (position 0's rows all follow the anchor [b]), and
        the greedy chain from the anchor: ids [b, P] and the chosen index per position [b, P]."""
        unary, candidates = torch.topk(logits.float(), self.top_k, dim=-1)
        query = self.hidden_projection(hidden).float()  # [b, P, r]
        successors = F.embedding(candidates, self.successor_codebook).float()  # [b, P, k, r]
        predecessors = F.embedding(candidates, self.predecessor_codebook).float()  # [b, P, k, r]
        first = F.embedding(anchor, self.predecessor_codebook).float()[:, None, None, :]  # [b, 1, 1, r]
        previous = torch.cat([first.expand(-1, 1, self.top_k, -1), predecessors[:, :-1]], dim=1)  # [b, P, k, r]
        scores = unary[:, :, None, :] + torch.einsum("bpir,bpr,bpcr->bpic", previous, query, successors)
        row = torch.zeros_like(anchor)
        chosen, ids = [], []
        for position in range(logits.shape[1]):
            step = scores[:, position].gather(1, row[:, None, None].expand(-1, 1, self.top_k))[:, 0]  # [b, k]
            row = torch.argmax(step, dim=-1)
            chosen.append(row)
            ids.append(candidates[:, position].gather(1, row[:, None])[:, 0])
        return candidates, scores, torch.stack(ids, 1), torch.stack(chosen, 1)


class MarkovHead(nn.Module):
    """DSpark's logit bias for a position from the token before it (and, gated or rnn, the position's hidden)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, kind: str, draft_vocab: int | None = None):
        """`draft_vocab`: a reduced-vocabulary draft's token count: the bias spans its tokens, while the previous
        token is looked up by its target id."""
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab or vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def step(self, previous: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """previous [..] ids, hidden [.., H]: (bias [.., V], the previous token's code [.., r], the rnn state)."""
        code = self.markov_w1(previous)
        if self.kind == "gated":
            mixed = torch.sigmoid(self.gate_proj(torch.cat([hidden, code], dim=-1))) * code
        elif self.kind == "rnn":
            state = torch.zeros_like(code) if state is None else state
            gate, candidate, out = self.joint_proj(torch.cat([state, code, hidden], dim=-1)).chunk(3, dim=-1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1 - gate) * torch.tanh(candidate)
            mixed = torch.tanh(out)
        else:
            mixed = code
        return self.markov_w2(mixed), code, state


class ConfidenceHead(nn.Module):
    """DSpark's predicted acceptance of a position's proposal: sigmoid of a linear map of its hidden state (and,
    with the Markov head, of the previous token's code)."""

    def __init__(self, features: int):
        super().__init__()
        self.proj = nn.Linear(features, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(features).float())[..., 0]
