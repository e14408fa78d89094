"""A target whose layers mix full attention with Gated-DeltaNet linear attention (Qwen3.5), as one graph.

forward(input_ids, position_ids, *state) -> logits, greedy_ids, target_hidden, *present, with the state in layer
order: a full-attention layer's key and value [batch, past, kv_heads, head_dim] as TappedTarget has them; a
linear-attention layer's conv rows, recurrent state and pending decay / key / delta (linear_attention.py), whose
outputs are the conv rows (past + new), the recurrent state after the pending rows, the state after this call's
tokens, and this call's decay / key / delta. The full-attention layers run transformers' own attention modules
on a DynamicCache; the linear ones run linear_attention.py on the modules' weights.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from dflash_onnx.exporter.models.linear_attention import GatedDeltaLayer
from dflash_onnx.exporter.models.target import TappedTarget, causal_mask
from dflash_onnx.runtime import recurrent
from dflash_onnx.runtime.manifest import RecurrentSpec

LINEAR = "linear_attention"
INPUTS_PER_LINEAR_LAYER = 5  # conv, recurrent, pending decay, key, delta
OUTPUTS_PER_LINEAR_LAYER = 6  # conv, recurrent (base), recurrent end, decay, key, delta


def is_hybrid(config) -> bool:
    return LINEAR in (getattr(config, "layer_types", None) or [])


def wrap_target(causal_lm, target_layer_ids: list[int]) -> TappedTarget:
    """The export wrapper for this model: HybridTarget where layers are linear attention, else TappedTarget."""
    hybrid = is_hybrid(causal_lm.config.get_text_config(decoder=True))
    return (HybridTarget if hybrid else TappedTarget)(causal_lm, target_layer_ids).eval()


def state_input_names(layer_types: list[str]) -> list[str]:
    return [name for i, kind in enumerate(layer_types) for name in
            (recurrent.input_names(i) if kind == LINEAR else [f"past_key_values.{i}.{k}" for k in ("key", "value")])]


def state_output_names(layer_types: list[str]) -> list[str]:
    return [name for i, kind in enumerate(layer_types) for name in
            (recurrent.output_names(i) if kind == LINEAR else [f"present.{i}.key", f"present.{i}.value"])]


class HybridTarget(TappedTarget):
    """TappedTarget for a decoder of full- and linear-attention layers (`layer_types`)."""

    def __init__(self, causal_lm, target_layer_ids: list[int]):
        super().__init__(causal_lm, target_layer_ids)
        self.linear = {i: GatedDeltaLayer(layer.linear_attn) for i, layer in enumerate(causal_lm.get_decoder().layers)
                       if self.layer_types[i] == LINEAR}
        self.attention_layers = list(self.kv_shapes)

    def empty_cache(self, batch: int = 1, dtype=torch.float32) -> list[torch.Tensor]:
        state = []
        for i in range(self.num_layers):
            if i in self.linear:
                state += self.linear[i].empty_state(batch, dtype)
            else:
                state += [torch.zeros(batch, 0, *self.kv_shapes[i], dtype=dtype) for _ in range(2)]
        return state

    def recurrent_spec(self) -> RecurrentSpec:
        layer = next(iter(self.linear.values()))
        return RecurrentSpec(layers=sorted(self.linear), conv_rows=layer.kernel - 1, conv_channels=layer.channels,
                             heads=layer.value_heads, key_dim=layer.key_dim, value_dim=layer.value_dim)

    def state_names(self) -> tuple[list[str], list[str]]:
        """The state inputs and outputs, in graph order."""
        return state_input_names(self.layer_types), state_output_names(self.layer_types)

    def next_state(self, present: tuple[torch.Tensor, ...], rows: int, committed: int) -> list[torch.Tensor]:
        """As dflash_onnx/runtime/recurrent.py commits: K/V sliced, conv rows [committed, committed + kernel - 1), the
        state
        after every row or before them with the first `committed` rows pending."""
        state, at = [], 0
        for i in range(self.num_layers):
            if i in self.linear:
                conv, base, end, *pending = present[at : at + OUTPUTS_PER_LINEAR_LAYER]
                whole = committed == rows
                state += [conv[:, committed : committed + self.linear[i].kernel - 1], end if whole else base,
                          *(p[:, : 0 if whole else committed] for p in pending)]
                at += OUTPUTS_PER_LINEAR_LAYER
            else:
                state += [t[:, : t.shape[1] - rows + committed] for t in present[at : at + 2]]
                at += 2
        return state

    def sample_state(self, batch: int, past: int, pending: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Tracing inputs: `past` K/V rows, `pending` rows per linear layer."""
        state = []
        for i in range(self.num_layers):
            if i in self.linear:
                conv, recurrent_state, *_ = self.linear[i].empty_state(batch, dtype)
                state += [conv, recurrent_state, *self.linear[i].empty_pending(batch, pending)]
            else:
                state += [torch.zeros(batch, past, *self.kv_shapes[i], dtype=dtype) for _ in range(2)]
        return state

    def state_dynamic_shapes(self, batch, past, pending) -> tuple[dict, ...]:
        shapes = []
        for i in range(self.num_layers):
            shapes += ([{0: batch}, {0: batch}] + [{0: batch, 1: pending}] * 3 if i in self.linear
                       else [{0: batch, 1: past}] * 2)
        return tuple(shapes)

    def _split(self, past: tuple[torch.Tensor, ...]):
        """{layer: its state inputs}, walking the layer-ordered inputs."""
        per_layer, at = {}, 0
        for i in range(self.num_layers):
            size = INPUTS_PER_LINEAR_LAYER if i in self.linear else 2
            per_layer[i], at = past[at : at + size], at + size
        return per_layer

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor):
        per_layer = self._split(past)
        first_kv = per_layer[self.attention_layers[0]][0]
        empty = first_kv[:, :0].transpose(1, 2)
        pairs = [(per_layer[i][0].transpose(1, 2), per_layer[i][1].transpose(1, 2)) if i not in self.linear
                 else (empty, empty) for i in range(self.num_layers)]
        cache = DynamicCache(ddp_cache_data=pairs)
        mask = causal_mask(position_ids, first_kv.shape[1] + input_ids.shape[1])
        decoder = self.lm.get_decoder()
        x = decoder.embed_tokens(input_ids)
        position_embeddings = decoder.rotary_emb(x, position_ids)
        hidden, present = [], []
        for i, layer in enumerate(decoder.layers):
            normed = layer.input_layernorm(x)
            if i in self.linear:
                out, *state = self.linear[i].forward(normed, *per_layer[i])
                present += state
            else:
                out, _ = layer.self_attn(hidden_states=normed, position_embeddings=position_embeddings,
                                         attention_mask=mask, cache=cache)
                present += [cache.layers[i].keys.transpose(1, 2), cache.layers[i].values.transpose(1, 2)]
            x = x + out
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            hidden.append(x)
        logits = self.head(decoder.norm(x))
        taps = torch.cat([hidden[i] for i in self.target_layer_ids], dim=-1)
        return (logits, torch.argmax(logits, dim=-1), taps, *present)
