"""Target and draft with K/V as module state: the form CoreML converts to `ct.StateType` (macOS 15 / iOS 18).

The same math as the retained (AI 100) form, except that each layer's K/V buffer [1, kv_heads, ctx_len,
head_dim] is a registered buffer written in place with a slice update at [start, start + T), which
coremltools turns into a state update. The rows of one call therefore sit at consecutive positions;
the runner pads a call by continuing the positions (slots past the committed length are never read
before a later call overwrites them), so a call never writes past ctx_len.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dflash_onnx.exporter.models.draft import DFlashDraft, visible
from dflash_onnx.exporter.models.target import TappedTarget
from dflash_onnx.runtime.errors import DFlashError


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """x [1, heads, T, D] rotated by cos/sin [1, T, D] (HF's rotate_half convention); `half` = D // 2 as a
    Python int (an int computed from a traced shape does not convert)."""
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype):
    """HF's default RoPE tables [1, T, D] for these positions (float32 angles)."""
    angles = position_ids[:, :, None].float() * inv_freq[None, None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
                      heads: int, kv_heads: int, dim: int) -> torch.Tensor:
    """SDPA of q [1, heads, T, D] over K/V [1, kv_heads, S, D] without repeating K/V per query head: each kv
    head's query group is folded into the query rows ([1, kv_heads, groups * T, D]; HF's head h reads kv head
    h // groups), the mask [1, 1, T, S] repeated per group. `scale` is left out where it is SDPA's default, so
    coremltools emits its fused scaled_dot_product_attention op (it decomposes the op when given a scale).
    Sizes are Python ints: ints read from traced shapes do not convert."""
    groups = heads // kv_heads
    folded = q.reshape(1, kv_heads, -1, dim)
    mask = mask.repeat(1, groups, 1, 1).flatten(1, 2)[:, None]
    default = abs(scale - dim**-0.5) <= 1e-9 * dim**-0.5
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, **({} if default else {"scale": scale}))
    return out.reshape(1, heads, -1, dim)


def _buffers(module: nn.Module, layers: range, kv_heads: int, ctx_len: int, head_dim: int, dtype) -> list[str]:
    names = []
    for i in layers:
        for kind in ("key", "value"):
            name = f"{kind}_cache_{i}"
            module.register_buffer(name, torch.zeros(1, kv_heads, ctx_len, head_dim, dtype=dtype))
            names.append(name)
    return names


class StatefulTarget(nn.Module):
    """forward(input_ids [1, T], position_ids [1, T]) -> greedy_ids, logits, context_hidden.

    As RetainedTarget: `context_hidden` is the draft's hidden_norm(fc(taps)), fc divided by `fc_scale`.

    A part (`layers` = (start, stop), a range of the decoder's layers; converted into its own package, so that no
    conversion holds more than a part's weights and each program stays small enough for the Neural Engine) holds
    those layers' K/V states only. The first part reads input_ids, the others forward(hidden_in, position_ids,
    tap_sum_in); every part but the last returns (hidden, tap_sum), the last the outputs above. fc of the
    concatenated taps is the sum over the parts of fc's columns for their taps times those taps, so only that sum
    travels between parts, never the taps.
    """

    def __init__(self, tapped: TappedTarget, draft: DFlashDraft, ctx_len: int, fc_scale: float = 1.0,
                 dtype=torch.float16, layers: tuple[int, int] | None = None):
        super().__init__()
        decoder = tapped.lm.get_decoder()
        needed = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")
        for layer in decoder.layers:
            if not all(hasattr(layer.self_attn, n) for n in needed) or not hasattr(layer, "mlp"):
                raise DFlashError(f"{type(layer).__name__}: the stateful (CoreML) target supports Llama-style "
                                  "decoder layers (Qwen3, Qwen2, Llama, Mistral)")
        count = tapped.num_layers
        self.start, self.stop = layers or (0, count)
        if not 0 <= self.start < self.stop <= count:
            raise DFlashError(f"layers {self.start}..{self.stop} are not a part of the target's {count} layers")
        self.first, self.last = self.start == 0, self.stop == count
        # only this part's modules: converting a part traces (and loads) nothing else
        self.embed_tokens = decoder.embed_tokens if self.first else None
        self.layers = nn.ModuleList(decoder.layers[self.start:self.stop])
        self.norm = decoder.norm if self.last else None
        self.lm_head = tapped.lm.get_output_embeddings() if self.last else None
        self.hidden_norm = draft.hidden_norm if self.last else None
        self.ctx_len = ctx_len
        self.taps = [i for i in tapped.target_layer_ids if self.start <= i < self.stop]
        text = tapped.lm.config.get_text_config(decoder=True)
        columns = [j for j, i in enumerate(tapped.target_layer_ids) if self.start <= i < self.stop]
        weight = draft.fc.weight.detach() / fc_scale
        if len(columns) < len(tapped.target_layer_ids):
            width = text.hidden_size
            weight = torch.cat([weight[:, j * width:(j + 1) * width] for j in columns], dim=1) if columns else None
        self.fc_weight = None if weight is None else nn.Parameter(weight, requires_grad=False)
        self.width, self.draft_width = text.hidden_size, draft.fc.weight.shape[0]
        self.state_names = _buffers(self, range(self.start, self.stop), tapped.num_kv_heads, ctx_len,
                                    tapped.head_dim, dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = text.num_attention_heads, tapped.num_kv_heads, \
            tapped.head_dim
        self.sliding_window = tapped.sliding_window
        self.layer_types = tapped.layer_types or ["full_attention" if tapped.sliding_window is None
                                                  else "sliding_attention"] * count
        rotary = decoder.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=False)
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))

    def _attention(self, index: int, layer: nn.Module, x: torch.Tensor, cos, sin, position_ids, start, end):
        """HF's attention math for one layer, K/V written into this module's state."""
        attn = layer.self_attn
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim  # Python ints (see _rotate)
        q = attn.q_proj(x).view(1, -1, heads, dim)
        k = attn.k_proj(x).view(1, -1, kv_heads, dim)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = _rotate(q.transpose(1, 2), cos, sin, dim // 2), _rotate(k.transpose(1, 2), cos, sin, dim // 2)
        v = attn.v_proj(x).view(1, -1, kv_heads, dim).transpose(1, 2)
        keys, values = getattr(self, f"key_cache_{index}"), getattr(self, f"value_cache_{index}")
        keys[:, :, start:end] = k.to(keys.dtype)
        values[:, :, start:end] = v.to(values.dtype)
        window = self.sliding_window if self.layer_types[index] == "sliding_attention" else None
        key_pos = torch.arange(self.ctx_len)[None, None, :]
        mask = visible(position_ids[:, :, None], key_pos, True, window)[:, None]
        out = grouped_attention(q, keys.to(q.dtype), values.to(q.dtype), mask, attn.scaling, heads, kv_heads, dim)
        return attn.o_proj(out.transpose(1, 2).reshape(1, -1, heads * dim))

    def forward(self, first: torch.Tensor, position_ids: torch.Tensor, tap_sum: torch.Tensor | None = None):
        start, end = position_ids[0, 0], position_ids[0, -1] + 1  # rows sit at consecutive positions
        x = self.embed_tokens(first) if self.first else first
        cos, sin = _cos_sin(position_ids, self.inv_freq, self.rope_scaling, x.dtype)
        taps = {}
        for index, layer in enumerate(self.layers, self.start):
            x = x + self._attention(index, layer, layer.input_layernorm(x), cos, sin, position_ids, start, end)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if index in self.taps:
                taps[index] = x
        if self.taps:
            fc = F.linear(torch.cat([taps[i] for i in self.taps], dim=-1), self.fc_weight)
            tap_sum = fc if tap_sum is None else tap_sum + fc
        elif tap_sum is None:
            tap_sum = x.new_zeros(1, x.shape[1], self.draft_width)
        if not self.last:
            return x, tap_sum
        logits = self.lm_head(self.norm(x))
        return torch.argmax(logits, dim=-1).to(torch.int32), logits, self.hidden_norm(tap_sum)


class StatefulDraft(nn.Module):
    """forward(input_ids [1, B], context_hidden [1, T, H], ctx_position_ids [1, T], position_ids [1, B],
    [*sampling]) -> draft_ids, draft_confidence, [*signal outputs], logits, [*extra outputs]. Context K/V are
    written into state; block K/V are attended, never cached.

    Each layer's body (DFlash2's convolutions included) and the proposal (DFlash's argmax, DFlash2's selector
    chain, DSpark's Markov chain and confidence head) are the draft's own (draft.py); the outputs after the logits
    are what sampling reads (DFlash2's candidates and their scores), and a DSpark draft with a Markov head takes
    `sample_uniform` and `sample_temperature` to draw its chain inside the call (temperature 0: greedy)."""

    def __init__(self, draft: DFlashDraft, ctx_len: int, block_size: int, dtype=torch.float16):
        super().__init__()
        self.draft = draft
        self.ctx_len, self.block_size = ctx_len, block_size
        self.state_names = _buffers(self, range(len(draft.layers)), draft.num_kv_heads, ctx_len, draft.head_dim,
                                    dtype)
        self.register_buffer("inv_freq", draft.rotary_emb.inv_freq.detach().float().clone(), persistent=False)
        self.rope_scaling = float(getattr(draft.rotary_emb, "attention_scaling", 1.0))

    def extra_inputs(self) -> list[str]:
        return self.draft.extra_inputs()

    def output_names(self) -> list[str]:
        return ["draft_ids", "draft_confidence", *self.draft.signal_outputs(), "logits", *self.draft.extra_outputs()]

    def forward(self, input_ids, context_hidden, ctx_position_ids, position_ids, *sampling):
        draft = self.draft
        hidden = F.embedding(input_ids, draft.embed_tokens) * draft.spec.input_embedding_scale
        cos_c, sin_c = _cos_sin(ctx_position_ids, self.inv_freq, self.rope_scaling, hidden.dtype)
        cos_b, sin_b = _cos_sin(position_ids, self.inv_freq, self.rope_scaling, hidden.dtype)
        start, end = ctx_position_ids[0, 0], ctx_position_ids[0, -1] + 1
        key_pos = torch.arange(self.ctx_len)[None, None, :]
        block_start = position_ids[:, :1, None]
        query_pos = position_ids[:, :, None]
        steps = self.block_size  # a Python int: ints read from traced shapes do not convert
        for i, layer in enumerate(draft.layers):
            attn = layer.self_attn

            def attend(h: torch.Tensor, attn=attn, i=i) -> torch.Tensor:
                heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
                keys, values = getattr(self, self.state_names[2 * i]), getattr(self, self.state_names[2 * i + 1])
                q = _rotate(attn.q_norm(attn.q_proj(h).view(1, steps, heads, dim)).transpose(1, 2), cos_b, sin_b,
                            dim // 2)
                k_ctx = attn.k_norm(attn.k_proj(context_hidden).view(1, -1, kv_heads, dim)).transpose(1, 2)
                v_ctx = attn.v_proj(context_hidden).view(1, -1, kv_heads, dim).transpose(1, 2)
                keys[:, :, start:end] = _rotate(k_ctx, cos_c, sin_c, dim // 2).to(keys.dtype)
                values[:, :, start:end] = v_ctx.to(values.dtype)
                k_blk = _rotate(attn.k_norm(attn.k_proj(h).view(1, steps, kv_heads, dim)).transpose(1, 2), cos_b,
                                sin_b, dim // 2)
                v_blk = attn.v_proj(h).view(1, steps, kv_heads, dim).transpose(1, 2)
                anchor = block_start if attn.window_from_anchor else None
                cached = visible(query_pos, key_pos, attn.is_causal, attn.sliding_window, anchor) & \
                    (key_pos < block_start)
                in_block = visible(query_pos, position_ids[:, None, :], attn.is_causal, attn.sliding_window, anchor)
                # a rule that does not depend on the query (a window counted from the anchor) gives one row
                mask = torch.cat([cached.expand(1, steps, -1), in_block.expand(1, steps, -1)], dim=-1)[:, None]
                all_keys = torch.cat([keys.to(q.dtype), k_blk], dim=2)
                all_values = torch.cat([values.to(q.dtype), v_blk], dim=2)
                out = grouped_attention(q, all_keys, all_values, mask, dim**-0.5, heads, kv_heads, dim)
                return attn.o_proj(out.transpose(1, 2).reshape(1, steps, heads * dim))

            hidden = layer.around(hidden, attend)
        logits, ids, *rest = draft.propose(draft.norm(hidden), input_ids[:, 0], tuple(sampling) or None)
        signals = 1 + len(draft.signal_outputs())
        return (ids.to(torch.int32), *rest[:signals], logits, *rest[signals:])
