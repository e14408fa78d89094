"""Fixed-size, position-indexed KV caches: the graph form for accelerators with retained state (AI 100).

Each layer's K/V live in a buffer [batch, kv_heads, ctx_len, head_dim] (QEfficient's layout) that the
graph returns whole as `*_RetainedState`. New K/V are scattered at their positions (slot = position),
reads mask slots after the query's position, so rollback is free: rejected slots are never read and
are overwritten by the next call before any query can see them. Rows padded up to a specialization's
size carry position ctx_len - 1 (the scratch slot), which only a query at that very position could read,
after its own write.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers.cache_utils import Cache, DynamicLayer

from .draft import DFlashDraft, _rope, confidence, visible
from .target import TappedTarget


def scatter_positions(buffer: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """buffer [B, H, C, D] with new [B, H, T, D] written at slots positions [B, T] (an ONNX ScatterND)."""
    batch, heads, steps = new.shape[0], new.shape[1], new.shape[2]
    b = torch.arange(batch, device=new.device)[:, None, None].expand(batch, heads, steps)
    h = torch.arange(heads, device=new.device)[None, :, None].expand(batch, heads, steps)
    p = positions[:, None, :].expand(batch, heads, steps)
    return buffer.index_put((b, h, p), new)


class ScatterLayer(DynamicLayer):
    """A cache layer over a fixed buffer: update() scatters at `positions` and returns the whole buffer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.positions = keys, values, positions
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys = scatter_positions(self.keys, key_states, self.positions)
        self.values = scatter_positions(self.values, value_states, self.positions)
        return self.keys, self.values


class RetainedTarget(nn.Module):
    """forward(input_ids, position_ids, *past) -> greedy_ids, logits, context_hidden, *retained.

    `context_hidden` is the draft's hidden_norm(fc(taps)): folding the draft's input projection here
    moves H instead of n_taps*H values per token from target to draft. fc's weight is divided by
    `fc_scale` (RMSNorm is scale invariant) so its output stays inside float16 range on the device.
    """

    def __init__(self, tapped: TappedTarget, draft: DFlashDraft, fc_scale: float = 1.0):
        super().__init__()
        self.tapped = tapped
        self.fc_weight = nn.Parameter(draft.fc.weight.detach() / fc_scale, requires_grad=False)
        self.hidden_norm = draft.hidden_norm

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor):
        tapped = self.tapped
        n = tapped.num_layers
        cache = Cache(layers=[ScatterLayer(past[2 * i], past[2 * i + 1], position_ids) for i in range(n)])
        key_pos = torch.arange(past[0].shape[2], device=input_ids.device)[None, None, :]
        query_pos = position_ids[:, :, None]
        full = visible(query_pos, key_pos, True, None)[:, None]
        masks = full
        if tapped.sliding_window is not None:
            windowed = visible(query_pos, key_pos, True, tapped.sliding_window)[:, None]
            masks = {"full_attention": full, "sliding_attention": windowed} if "sliding_attention" in \
                tapped.layer_types else windowed
        out = tapped.lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, attention_mask=masks,
                                      cache=cache, use_cache=True, output_hidden_states=True)
        logits = tapped.lm.get_output_embeddings()(out.last_hidden_state)
        taps = torch.cat([out.hidden_states[i + 1] for i in tapped.target_layer_ids], dim=-1)
        context = self.hidden_norm(F.linear(taps, self.fc_weight))
        retained: list[torch.Tensor] = []
        for layer in cache.layers:
            retained += [layer.keys, layer.values]
        return (torch.argmax(logits, dim=-1), logits, context, *retained)


class RetainedDraft(nn.Module):
    """forward(input_ids, context_hidden, ctx_position_ids, position_ids, *past) -> draft_ids, logits, *retained.

    Context rows (already hidden_norm(fc(.)) from the target graph) are written into the context cache
    at their positions; block K/V are computed, attended and never cached.
    """

    def __init__(self, draft: DFlashDraft):
        super().__init__()
        self.draft = draft

    def forward(self, input_ids, context_hidden, ctx_position_ids, position_ids, *past):
        draft = self.draft
        hidden = F.embedding(input_ids, draft.embed_tokens) * draft.spec.input_embedding_scale
        cos_c, sin_c = draft.rotary_emb(hidden, ctx_position_ids)
        cos_b, sin_b = draft.rotary_emb(hidden, position_ids)
        key_pos = torch.arange(past[0].shape[2], device=hidden.device)[None, None, :]
        block_start = position_ids[:, :1, None]
        query_pos = position_ids[:, :, None]
        retained: list[torch.Tensor] = []
        for i, layer in enumerate(draft.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(hidden)
            q = _rope(attn.q_norm(attn._heads(attn.q_proj(h), attn.num_heads)), cos_b, sin_b).transpose(1, 2)
            k_ctx = _rope(attn.k_norm(attn._heads(attn.k_proj(context_hidden), attn.num_kv_heads)), cos_c, sin_c)
            v_ctx = attn._heads(attn.v_proj(context_hidden), attn.num_kv_heads)
            k_blk = _rope(attn.k_norm(attn._heads(attn.k_proj(h), attn.num_kv_heads)), cos_b, sin_b).transpose(1, 2)
            v_blk = attn._heads(attn.v_proj(h), attn.num_kv_heads).transpose(1, 2)
            keys = scatter_positions(past[2 * i], k_ctx.transpose(1, 2), ctx_position_ids)
            values = scatter_positions(past[2 * i + 1], v_ctx.transpose(1, 2), ctx_position_ids)
            retained += [keys, values]
            cached = visible(query_pos, key_pos, attn.is_causal, attn.sliding_window) & (key_pos < block_start)
            in_block = visible(query_pos, position_ids[:, None, :], attn.is_causal, attn.sliding_window)
            mask = torch.cat([cached, in_block], dim=-1)[:, None]
            out = F.scaled_dot_product_attention(
                q, torch.cat([keys, k_blk], dim=2), torch.cat([values, v_blk], dim=2), attn_mask=mask,
                scale=attn.head_dim**-0.5, enable_gqa=attn.num_heads != attn.num_kv_heads,
            )
            out = out.transpose(1, 2).reshape(hidden.shape[0], hidden.shape[1], -1)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = draft.logits(draft.norm(hidden)[:, 1:])
        return (torch.argmax(logits, dim=-1), confidence(logits), logits, *retained)
