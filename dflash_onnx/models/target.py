"""The target LLM as the graph the decoding loop needs: logits, greedy ids, tapped features, explicit KV.

Wraps any Hugging Face causal LM whose decoder accepts a `cache=` DynamicCache and a ready 4D mask
(Qwen3, Llama, Qwen2, Mistral ...). K/V tensors cross the graph boundary as [batch, seq, kv_heads,
head_dim] so that a committed prefix of a present tensor is a contiguous view the host can feed back
without copying (see README, "KV state").
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache


def causal_mask(position_ids: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[batch, 1, seq, keys] boolean mask: key slot j is position j, visible when j <= the query's position."""
    key_pos = torch.arange(num_keys, device=position_ids.device)
    return (key_pos[None, None, None, :] <= position_ids[:, None, :, None])


class TappedTarget(nn.Module):
    """forward(input_ids, position_ids, *past) -> logits, greedy_ids, target_hidden, *present."""

    def __init__(self, causal_lm: nn.Module, target_layer_ids: list[int]):
        super().__init__()
        self.lm = causal_lm
        self.target_layer_ids = list(target_layer_ids)
        text = causal_lm.config.get_text_config(decoder=True)
        self.num_layers = text.num_hidden_layers
        self.num_kv_heads = text.num_key_value_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads

    def empty_cache(self, batch: int = 1, dtype=torch.float32) -> list[torch.Tensor]:
        shape = (batch, 0, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=dtype) for _ in range(2 * self.num_layers)]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor):
        pairs = [(past[2 * i].transpose(1, 2), past[2 * i + 1].transpose(1, 2)) for i in range(self.num_layers)]
        cache = DynamicCache(ddp_cache_data=pairs, config=self.lm.config)
        num_keys = past[0].shape[1] + input_ids.shape[1]
        out = self.lm.get_decoder()(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=causal_mask(position_ids, num_keys),
            cache=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        logits = self.lm.get_output_embeddings()(out.last_hidden_state)
        hidden = torch.cat([out.hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)
        present: list[torch.Tensor] = []
        for layer in out.cache.layers:
            present += [layer.keys.transpose(1, 2), layer.values.transpose(1, 2)]
        return (logits, torch.argmax(logits, dim=-1), hidden, *present)
