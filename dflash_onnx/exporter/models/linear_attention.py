"""Gated-DeltaNet linear-attention layers (Qwen3.5) with their state as graph inputs and outputs.

A linear-attention layer carries two states instead of K/V: the causal convolution's last `kernel - 1` input
rows, and a recurrent state [batch, heads, key_dim, value_dim] that every token updates. A DFlash verify runs
tokens that may be rejected, and a recurrent state cannot be sliced back like K/V. So the graph returns, for each
of its tokens, the update it applied (the decay, the key and the delta of the gated delta rule: small), and the
host commits the accepted prefix by handing those rows back as `pending` with the next call, which applies them
to the state before its own tokens, with the same operations a token's own step uses. A call therefore needs no
state per position, a partial acceptance commits exactly the accepted prefix's state, and the state after a
token never depends on how many tokens its call held (greedy and DFlash stay identical). The convolution's rows
roll back like K/V: the graph returns past + new rows and the host keeps the last `kernel - 1` committed ones.

The recurrence runs as a torch `scan` (an ONNX Scan): one token after another, as transformers' recurrent
kernel computes it; its chunked prefill kernel rounds differently and is not used.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._higher_order_ops.scan import scan
from torch.nn import functional as F
from transformers.activations import ACT2FN


def _token_step(state: torch.Tensor, xs: tuple[torch.Tensor, ...]):
    """One token of the gated delta rule on state [B, H, Dk, Dv], its operands shaped outside the Scan (see
    `_token_operands`) so the loop body is nine operations. Returns the new state, the token's output and its
    delta, both [B, H, 1, Dv].

    The state is read once, by one matmul of the key and the query against the decayed state; the output then
    follows from the update without reading the new state again (q.(S + k x delta) = q.S + (q.k) delta): the state
    is [H, Dk, Dv] floats per token and layer, so each pass over it is what a verify's tokens pay."""
    decay, key_and_query, key, value, beta, query_dot_key = xs
    state = state * decay
    remembered, read = (key_and_query @ state).split(1, dim=-2)
    delta = (value - remembered) * beta
    return _add_update(state, key, delta), (read + query_dot_key * delta, delta)


def _token_operands(decay, key, value, beta, query) -> tuple[torch.Tensor, ...]:
    """Per-token operands of _token_step for all of a call's tokens at once, time first: decay and beta [.., H, 1,
    1], the key and the query stacked [.., H, 2, Dk], the key as a column [.., H, Dk, 1], the value as a row [.., H,
    1, Dv], q.k [.., H, 1, 1]."""
    operands = (decay[..., None, None], torch.stack([key, query], dim=-2), key[..., None], value[..., None, :],
                beta[..., None, None], (query * key).sum(dim=-1)[..., None, None])
    return _time_first(*operands)


def _add_update(state: torch.Tensor, key: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """state + key x delta (a column [.., Dk, 1] times a row [.., 1, Dv]): a matmul with an inner size of one, each
    element one product as a broadcast Mul would round it, without that kernel's cost."""
    return state + key @ delta


def _commit_step(state: torch.Tensor, xs: tuple[torch.Tensor, ...]):
    """A committed token's update replayed from its decay, key and delta (shaped as _token_step's): the same
    operations as _token_step. The per-row output is an unused scalar: torch.onnx writes a Scan without outputs
    with an untyped attribute."""
    decay, key, delta = xs
    return _add_update(state * decay, key, delta), decay.sum(dim=(-2, -1))


def _commit_operands(decay, key, delta) -> tuple[torch.Tensor, ...]:
    """Committed rows shaped as _token_step's operands, time first: decay [.., H, 1, 1], key [.., H, Dk, 1], delta
    [.., H, 1, Dv]."""
    return _time_first(decay[..., None, None], key[..., None], delta[..., None, :])


def _time_first(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.transpose(0, 1) for t in tensors)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaLayer:
    """The state shapes and the math of one transformers Gated-DeltaNet module (Qwen3_5GatedDeltaNet,
    Qwen3NextGatedDeltaNet)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.kernel = int(module.conv_kernel_size)
        self.key_heads, self.value_heads = int(module.num_k_heads), int(module.num_v_heads)
        self.key_dim, self.value_dim = int(module.head_k_dim), int(module.head_v_dim)
        self.channels = int(module.conv_dim)

    def empty_state(self, batch: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """conv rows [B, kernel - 1, channels] (model dtype), recurrent [B, H, Dk, Dv] (float32, as transformers
        keeps it), and no pending rows."""
        return [torch.zeros(batch, self.kernel - 1, self.channels, dtype=dtype),
                torch.zeros(batch, self.value_heads, self.key_dim, self.value_dim, dtype=torch.float32),
                *self.empty_pending(batch)]

    def empty_pending(self, batch: int, rows: int = 0) -> list[torch.Tensor]:
        heads = self.value_heads
        return [torch.zeros(batch, rows, heads), torch.zeros(batch, rows, heads, self.key_dim),
                torch.zeros(batch, rows, heads, self.value_dim)]

    def _projections(self, x: torch.Tensor):
        """The conv input [B, T, channels] (q, k, v), the output gate z [B, T, heads, Dv], and b, a [B, T, heads]:
        from separate projections (Qwen3.5), or from Qwen3-Next's two interleaved ones, split by its own method."""
        m = self.module
        batch, steps = x.shape[0], x.shape[1]
        if hasattr(m, "in_proj_qkvz"):
            query, key, value, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
            mixed = torch.cat([t.reshape(batch, steps, -1) for t in (query, key, value)], dim=-1)
            return mixed, z, b, a
        z = m.in_proj_z(x).reshape(batch, steps, self.value_heads, self.value_dim)
        return m.in_proj_qkv(x), z, m.in_proj_b(x), m.in_proj_a(x)

    def forward(self, x: torch.Tensor, conv_past: torch.Tensor, recurrent: torch.Tensor, pending_decay: torch.Tensor,
                pending_key: torch.Tensor, pending_delta: torch.Tensor):
        """x [B, T, hidden] -> (output [B, T, hidden], conv rows [B, kernel - 1 + T, channels], the recurrent
        state after the pending rows, the state after this call's tokens, and this call's decay, key, delta)."""
        m = self.module
        batch, steps = x.shape[0], x.shape[1]
        mixed, gate, b, a = self._projections(x)
        rows = torch.cat([conv_past.to(mixed.dtype), mixed], dim=1)
        weight = m.conv1d.weight[:, 0].to(mixed.dtype)  # [channels, kernel]: tap j reads row t + j of the window
        conv = sum(rows[:, j : j + steps] * weight[:, j] for j in range(self.kernel))
        if m.conv1d.bias is not None:
            conv = conv + m.conv1d.bias
        conv = ACT2FN[m.activation](conv)  # the config's hidden_act, as the module applies it
        query, key, value = torch.split(conv, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        groups = self.value_heads // self.key_heads
        query = query.reshape(batch, steps, self.key_heads, self.key_dim).repeat_interleave(groups, dim=2).float()
        key = key.reshape(batch, steps, self.key_heads, self.key_dim).repeat_interleave(groups, dim=2).float()
        value = value.reshape(batch, steps, self.value_heads, self.value_dim).float()
        query, key = _l2norm(query) * self.key_dim**-0.5, _l2norm(key)
        beta = b.sigmoid().float()
        decay = torch.exp(-m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias))

        # a neutral first row (decay 1, key and delta 0: the state unchanged, exactly), as scan needs one row
        pending = [torch.cat([p.new_full((p.shape[0], 1, *p.shape[2:]), float(i == 0)), p], dim=1)
                   for i, p in enumerate((pending_decay, pending_key, pending_delta))]
        base, _ = scan(_commit_step, recurrent, _commit_operands(*pending))
        end, (out, delta) = scan(_token_step, base, _token_operands(decay, key, value, beta, query))
        out, delta = out.squeeze(-2).transpose(0, 1).to(x.dtype), delta.squeeze(-2).transpose(0, 1)
        out = m.norm(out.reshape(-1, self.value_dim), gate.reshape(-1, self.value_dim))
        output = m.out_proj(out.reshape(batch, steps, -1))
        return output, rows, base, end, decay, key, delta
