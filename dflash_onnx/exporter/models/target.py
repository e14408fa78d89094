"""The target LLM as the graph the decoding loop needs: logits, greedy ids, tapped features, explicit KV.

Wraps any Hugging Face causal LM whose decoder accepts a `cache=` DynamicCache and ready masks
(Qwen3, Qwen2, Llama, Mistral ...); `check_against_hf` proves the wrapper reproduces the model's own
logits before anything is exported. K/V tensors cross the graph boundary as [batch, seq, kv_heads,
head_dim] so that a committed prefix of a present tensor is a contiguous view the host can feed back
without copying (see README, "KV state").
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from dflash_onnx.runtime.errors import DFlashError

# Logit post-processing that lives in a CausalLM head's forward, which this wrapper does not replay (Gemma's
# final_logit_softcapping it does: TappedTarget.forward).
UNSUPPORTED_HEAD_OPTIONS = {"logits_scaling": 1.0, "logit_scale": 1.0}


def kv_layer_shapes(text) -> dict[int, tuple[int, int]]:
    """{layer: (kv_heads, head_dim)} for each layer that keeps K/V of its own: not a linear-attention layer (Qwen3.5)
    and not one reading an earlier layer's K/V (Gemma 4's num_kv_shared_layers); shapes per layer where the config
    sets them per layer (Gemma 4's full-attention layers: global_head_dim, num_global_key_value_heads)."""
    count = text.num_hidden_layers
    per_layer = getattr(text, "per_layer_config", None)
    sharing = getattr(text, "kv_sharing_modes", None) or [None] * count
    types = getattr(text, "layer_types", None) or [None] * count
    shapes = {}
    for i in range(count):
        if sharing[i] == "reuse" or types[i] == "linear_attention":
            continue
        layer = per_layer[i] if per_layer is not None else text
        head_dim = getattr(layer, "head_dim", None) or text.hidden_size // text.num_attention_heads
        shapes[i] = (int(layer.num_key_value_heads), int(head_dim))
    return shapes


def causal_mask(position_ids: torch.Tensor, num_keys: int, window: int | None = None) -> torch.Tensor:
    """[batch, 1, seq, keys] boolean mask: key slot j holds position j, visible when j <= the query's
    position (and, with a sliding window, when the query is fewer than `window` positions ahead)."""
    key_pos = torch.arange(num_keys, device=position_ids.device)[None, None, None, :]
    query_pos = position_ids[:, None, :, None]
    visible = key_pos <= query_pos
    if window is not None:
        visible = visible & (query_pos - key_pos < window)
    return visible


class TappedTarget(nn.Module):
    """forward(input_ids, position_ids, *past) -> logits, greedy_ids, target_hidden, *present."""

    def __init__(self, causal_lm: nn.Module, target_layer_ids: list[int]):
        super().__init__()
        self.lm = causal_lm
        self.target_layer_ids = list(target_layer_ids)
        text = causal_lm.config.get_text_config(decoder=True)
        self.num_layers = text.num_hidden_layers
        self.kv_shapes = kv_layer_shapes(text)  # the layers with K/V of their own, in order, and their shapes
        if not self.kv_shapes:
            raise DFlashError(f"target {text.model_type}: no layer keeps K/V of its own (every layer is linear "
                              "attention or reads another's): not supported yet")
        self.num_kv_heads, self.head_dim = next(iter(self.kv_shapes.values()))  # the first's (uniform_kv: all)
        self.uniform_kv = len(set(self.kv_shapes.values())) == 1
        self.softcap = getattr(text, "final_logit_softcapping", None) or None
        # a window only where the config applies it (Qwen2-MoE keeps sliding_window 0 with use_sliding_window off)
        uses_window = getattr(text, "use_sliding_window", True)
        self.sliding_window = (getattr(text, "sliding_window", None) or None) if uses_window else None
        self.layer_types = list(getattr(text, "layer_types", None) or [])
        # eager attention (gpt-oss) adds the mask to its scores: 0 where visible, the dtype's lowest elsewhere
        self.additive_masks = getattr(causal_lm.config, "_attn_implementation", "sdpa") == "eager"

    def empty_cache(self, batch: int = 1, dtype=torch.float32) -> list[torch.Tensor]:
        return self.sample_state(batch, 0, 0, dtype)

    def sample_state(self, batch: int, past: int, pending: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """State inputs with `past` K/V rows (tracing inputs; `pending` is the hybrid's)."""
        return [torch.zeros(batch, past, heads, dim, dtype=dtype)
                for heads, dim in self.kv_shapes.values() for _ in ("key", "value")]

    def state_dynamic_shapes(self, batch, past, pending) -> tuple[dict, ...]:
        return tuple({0: batch, 1: past} for _ in range(2 * len(self.kv_shapes)))

    def state_names(self) -> tuple[list[str], list[str]]:
        """The state (K/V) inputs and outputs, in graph order."""
        return ([f"past_key_values.{i}.{kind}" for i in self.kv_shapes for kind in ("key", "value")],
                [f"present.{i}.{kind}" for i in self.kv_shapes for kind in ("key", "value")])

    def next_state(self, present: tuple[torch.Tensor, ...], rows: int, committed: int) -> list[torch.Tensor]:
        """The state inputs after a call of `rows` tokens that returned `present`, keeping its first `committed`."""
        return [t[:, : t.shape[1] - rows + committed] for t in present]

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window as `_masks` applies it: every layer's where no layer type says otherwise
        (Mistral), the sliding_attention layers' in models of both kinds; None: it sees every earlier position."""
        if self.sliding_window is None:
            return None
        typed = "sliding_attention" in self.layer_types
        return self.sliding_window if not typed or self.layer_types[layer] == "sliding_attention" else None

    def _masks(self, position_ids: torch.Tensor, num_keys: int):
        """Per-layer-type masks for hybrid models, one windowed mask for all-sliding ones (Mistral)."""
        full = self._form(causal_mask(position_ids, num_keys))
        if self.sliding_window is None:
            return full
        windowed = self._form(causal_mask(position_ids, num_keys, self.sliding_window))
        if "sliding_attention" in self.layer_types:
            return {"full_attention": full, "sliding_attention": windowed}
        return windowed

    def _form(self, visible: torch.Tensor) -> torch.Tensor:
        """A boolean mask as the attention reads it: as it is (SDPA), or additive (eager)."""
        if not self.additive_masks:
            return visible
        dtype = self.lm.get_input_embeddings().weight.dtype
        return torch.zeros((), dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits as the CausalLM's forward returns them: Gemma's final softcapping applied as it applies it."""
        logits = self.lm.get_output_embeddings()(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor):
        # The layers with K/V of their own come first (Gemma 4's sharing layers read theirs inside the forward)
        pairs = [(past[2 * k].transpose(1, 2), past[2 * k + 1].transpose(1, 2)) for k in range(len(self.kv_shapes))]
        # Plain (non-sliding) cache layers: the host owns the K/V and the masks apply any window.
        cache = DynamicCache(ddp_cache_data=pairs)
        num_keys = past[0].shape[1] + input_ids.shape[1]
        out = self.lm.get_decoder()(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=self._masks(position_ids, num_keys),
            cache=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        logits = self.head(out.last_hidden_state)
        hidden = torch.cat([out.hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)
        present: list[torch.Tensor] = []
        cache = out.cache if hasattr(out, "cache") else out.past_key_values  # the older transformers 5 name
        for layer in cache.layers[: len(self.kv_shapes)]:
            present += [layer.keys.transpose(1, 2), layer.values.transpose(1, 2)]
        return (logits, torch.argmax(logits, dim=-1), hidden, *present)


def check_against_hf(tapped: TappedTarget, tolerance: float) -> None:
    """Refuse a target whose own forward this wrapper does not reproduce (masks, head post-processing)."""
    text = tapped.lm.config.get_text_config(decoder=True)
    for option, neutral in UNSUPPORTED_HEAD_OPTIONS.items():
        value = getattr(text, option, neutral)
        if value is not None and value != neutral:
            raise DFlashError(f"target {text.model_type} uses {option}={value}: not supported yet")
    length = min(64, max(12, (tapped.sliding_window or 0) + 6))
    ids = torch.arange(length)[None] % text.vocab_size
    with torch.no_grad():
        ours = tapped(ids, torch.arange(length)[None], *tapped.empty_cache(dtype=tapped.lm.dtype))[0]
        theirs = tapped.lm(input_ids=ids).logits
    diff = float((ours.float() - theirs.float()).abs().max())
    if diff > tolerance:
        raise DFlashError(
            f"target {text.model_type}: the exported wrapper's logits differ from the model's own by {diff:.3g} "
            "(an attention mask or logit post-processing this exporter does not reproduce): not supported yet"
        )


def hf_greedy(lm: nn.Module, prompt_ids: list[int], max_new_tokens: int, stop_token_ids: list[int] | None,
              streamer=None) -> list[int]:
    """Hugging Face greedy `generate`, the oracle DFlash output is checked against: it stops at
    `stop_token_ids` (HF's own eos when that is empty), or runs exactly `max_new_tokens` when it is None."""
    ids = torch.tensor(list(prompt_ids))[None]
    stops = stop_token_ids or []
    with torch.inference_mode():
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          min_new_tokens=max_new_tokens if stop_token_ids is None else 0, do_sample=False,
                          eos_token_id=stops or None, pad_token_id=stops[0] if stops else 0, streamer=streamer)
    return out[0, ids.shape[1]:].tolist()
