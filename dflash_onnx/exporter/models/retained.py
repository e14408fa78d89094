"""Fixed-size, position-indexed KV caches: the graph form for accelerators with retained state (AI 100).

Each layer's K/V live in a buffer [batch, kv_heads, ctx_len, head_dim] (QEfficient's layout) that the
graph returns whole as `*_RetainedState`. New K/V are scattered at their positions (slot = position);
reads cover only the first CCL slots, where CCL is the length of the `comp_ctx_lengths` input (a
compute-context-length specialization, QEfficient's convention), so a call's K/V traffic grows with the
context it needs rather than with ctx_len. Reads mask slots after the query's position, so rollback is free:
rejected slots are never read and are overwritten by the next call before any query can see them. Rows
padded up to a specialization's size carry position ctx_len - 1 (the scratch slot), which no real query reads.

Float16 safety on a compiler that converts the whole graph (`-convert-to-fp16`): rotary cos/sin come from
tables precomputed in float32 and gathered by position (no in-graph `position * inv_freq -> Cos/Sin`, whose
float16 angle error grows with the position), and greedy graphs emit int32 ids, never logits.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers.cache_utils import Cache, DynamicLayer

from dflash_onnx.exporter.models.draft import DFlashDraft, _rope, visible
from dflash_onnx.exporter.models.target import TappedTarget


class RotaryTable(nn.Module):
    """A rotary module's cos/sin for positions 0..ctx_len-1, computed once in float32 and gathered by position id:
    forward(x, position_ids) is a drop-in for the Hugging Face rotary module it was built from."""

    def __init__(self, rotary: nn.Module, ctx_len: int):
        super().__init__()
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(ctx_len)[None])
        self.register_buffer("cos_table", cos[0].float().contiguous(), persistent=False)
        self.register_buffer("sin_table", sin[0].float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_table[position_ids].to(x.dtype), self.sin_table[position_ids].to(x.dtype)


def scatter_positions(buffer: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """buffer [B, H, C, D] with new [B, H, T, D] written at slots positions [B, T] (an ONNX ScatterND)."""
    batch, heads, steps = new.shape[0], new.shape[1], new.shape[2]
    b = torch.arange(batch, device=new.device)[:, None, None].expand(batch, heads, steps)
    h = torch.arange(heads, device=new.device)[None, :, None].expand(batch, heads, steps)
    p = positions[:, None, :].expand(batch, heads, steps)
    return buffer.index_put((b, h, p), new)


class ScatterLayer(DynamicLayer):
    """A cache layer over a fixed buffer: update() scatters at `positions` and returns the first `read` slots."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, read: int):
        super().__init__()
        self.keys, self.values, self.positions, self.read = keys, values, positions, read
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys = scatter_positions(self.keys, key_states, self.positions)
        self.values = scatter_positions(self.values, value_states, self.positions)
        return self.keys[:, :, : self.read], self.values[:, :, : self.read]


def _ids(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1).to(torch.int32)


class RetainedTarget(nn.Module):
    """forward(input_ids, position_ids, comp_ctx_lengths, *past) -> greedy_ids, context_hidden, [logits], *retained.

    `context_hidden` is the draft's hidden_norm(fc(taps)): folding the draft's input projection here
    moves H instead of n_taps*H values per token from target to draft. fc's weight is divided by
    `fc_scale` (RMSNorm is scale invariant) so its output stays inside float16 range on the device.
    `logits` is an output only with `with_logits` (sampling); greedy decoding moves ids only.
    The decoder's rotary module is replaced by its table (positions below `ctx_len`).
    """

    def __init__(self, tapped: TappedTarget, draft: DFlashDraft, fc_scale: float, ctx_len: int,
                 with_logits: bool = False):
        super().__init__()
        self.tapped = tapped
        self.with_logits = with_logits
        self.fc_weight = nn.Parameter(draft.fc.weight.detach() / fc_scale, requires_grad=False)
        self.hidden_norm = draft.hidden_norm
        decoder = tapped.lm.get_decoder()
        decoder.rotary_emb = RotaryTable(decoder.rotary_emb, ctx_len)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, comp_ctx_lengths: torch.Tensor,
                *past: torch.Tensor):
        tapped = self.tapped
        read = comp_ctx_lengths.shape[0]
        cache = Cache(layers=[ScatterLayer(past[2 * i], past[2 * i + 1], position_ids, read)
                              for i in range(tapped.num_layers)])
        key_pos = torch.arange(past[0][:, :, :read].shape[2], device=input_ids.device)[None, None, :]
        query_pos = position_ids[:, :, None]
        masks = full = visible(query_pos, key_pos, True, None)[:, None]
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
        return (_ids(logits), context, *([logits] if self.with_logits else []), *retained)


class RetainedDraft(nn.Module):
    """forward(input_ids, context_hidden, ctx_position_ids, position_ids, comp_ctx_lengths, *past, [*sampling])
    -> draft_ids, draft_confidence, [*signal outputs], [logits, *extra outputs], *retained.

    Context rows (already hidden_norm(fc(.)) from the target graph) are written into the cache at their
    positions and the block's K/V at the block's positions, then every layer attends over the first CCL slots:
    no per-layer concatenation of the cache with the block. The block's slots hold noise afterwards, which no
    later query reads: the next call writes its context rows there before its block can see them.

    Each layer's body (DFlash2's convolutions included) and the proposal (DFlash's argmax, DFlash2's selector
    chain, DSpark's Markov chain and confidence head) are the draft's own (draft.py), so every kind has this form.
    With `with_logits` (sampling) the graph also returns what sampling reads besides the logits (DFlash2's
    candidates and their scores) and a DSpark draft with a Markov head takes `sample_uniform` and
    `sample_temperature` to draw its chain inside the call; without it, a greedy graph, the chain is argmax only.
    """

    def __init__(self, draft: DFlashDraft, ctx_len: int, with_logits: bool = False):
        super().__init__()
        self.draft = draft
        self.with_logits = with_logits
        draft.rotary_emb = RotaryTable(draft.rotary_emb, ctx_len)

    def extra_inputs(self) -> list[str]:
        return self.draft.extra_inputs() if self.with_logits else []

    def output_names(self) -> list[str]:
        """The graph's outputs before the retained K/V."""
        return ["draft_ids", "draft_confidence", *self.draft.signal_outputs(),
                *(["logits", *self.draft.extra_outputs()] if self.with_logits else [])]

    def forward(self, input_ids, context_hidden, ctx_position_ids, position_ids, comp_ctx_lengths, *rest):
        draft = self.draft
        count = 2 * len(draft.layers)
        past, sampling = rest[:count], tuple(rest[count:]) or None
        read = comp_ctx_lengths.shape[0]
        hidden = F.embedding(input_ids, draft.embed_tokens) * draft.spec.input_embedding_scale
        cos_c, sin_c = draft.rotary_emb(hidden, ctx_position_ids)
        cos_b, sin_b = draft.rotary_emb(hidden, position_ids)
        key_pos = torch.arange(past[0][:, :, :read].shape[2], device=hidden.device)[None, None, :]
        block_end = position_ids[:, -1:, None]
        anchor = position_ids[:, :1, None]
        query_pos = position_ids[:, :, None]
        retained: list[torch.Tensor] = []
        for i, layer in enumerate(draft.layers):
            attn = layer.self_attn

            def attend(h: torch.Tensor, attn=attn, i=i) -> torch.Tensor:
                q = _rope(attn.q_norm(attn._heads(attn.q_proj(h), attn.num_heads)), cos_b, sin_b).transpose(1, 2)
                k_ctx = _rope(attn.k_norm(attn._heads(attn.k_proj(context_hidden), attn.num_kv_heads)), cos_c,
                              sin_c)
                v_ctx = attn._heads(attn.v_proj(context_hidden), attn.num_kv_heads)
                k_blk = _rope(attn.k_norm(attn._heads(attn.k_proj(h), attn.num_kv_heads)), cos_b, sin_b)
                v_blk = attn._heads(attn.v_proj(h), attn.num_kv_heads)
                keys = scatter_positions(past[2 * i], k_ctx.transpose(1, 2), ctx_position_ids)
                values = scatter_positions(past[2 * i + 1], v_ctx.transpose(1, 2), ctx_position_ids)
                keys = scatter_positions(keys, k_blk.transpose(1, 2), position_ids)
                values = scatter_positions(values, v_blk.transpose(1, 2), position_ids)
                retained.extend((keys, values))
                seen = visible(query_pos, key_pos, attn.is_causal, attn.sliding_window,
                               anchor if attn.window_from_anchor else None)
                mask = (seen & (key_pos <= block_end))[:, None]
                out = F.scaled_dot_product_attention(
                    q, keys[:, :, :read], values[:, :, :read], attn_mask=mask,
                    scale=attn.head_dim**-0.5, enable_gqa=attn.num_heads != attn.num_kv_heads,
                )
                return attn.o_proj(out.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1))

            hidden = layer.around(hidden, attend)
        logits, ids, *rest = draft.propose(draft.norm(hidden), input_ids[:, 0], sampling)
        signals = 1 + len(draft.signal_outputs())
        visible_outputs = [ids.to(torch.int32), *(signal.float() for signal in rest[:signals])]
        if self.with_logits:
            visible_outputs += [logits, *rest[signals:]]
        return (*visible_outputs, *retained)
