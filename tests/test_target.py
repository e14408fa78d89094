"""The tapped target wrapper against the HF model's own forward, incl. sliding-window masks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_onnx.exporter.models.target import TappedTarget, check_against_hf
from dflash_onnx.runtime.errors import DFlashError

SMALL = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
CASES = {
    "llama": ("llama", {}),
    "qwen3_hybrid_sliding": ("qwen3", {"use_sliding_window": True, "sliding_window": 3,
                                       "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "qwen2_max_window_layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}),
    "mistral_all_sliding": ("mistral", {"sliding_window": 3}),
}


def _model(model_type: str, **extra):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **SMALL, **extra)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("name", sorted(CASES))
def test_wrapper_reproduces_hf_logits_hidden_states_and_cache(name):
    model_type, extra = CASES[name]
    lm = _model(model_type, **extra)
    tapped = TappedTarget(lm, [0, 1])
    ids = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        full = lm(ids, output_hidden_states=True)
        logits, greedy, hidden, *present = tapped(ids[:, :7], torch.arange(7)[None], *tapped.empty_cache())
        step = tapped(ids[:, 7:], torch.arange(7, 12)[None], *present)  # a later call on the cache
    torch.testing.assert_close(logits, full.logits[:, :7], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(step[0], full.logits[:, 7:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(hidden, torch.cat([full.hidden_states[1], full.hidden_states[2]], -1)[:, :7])
    assert torch.equal(greedy, logits.argmax(-1))
    check_against_hf(tapped, 2e-3)


def test_unsupported_logit_post_processing_is_refused():
    lm = _model("granite", logits_scaling=8.0)
    with pytest.raises(DFlashError, match="logits_scaling=8.0: not supported yet"):
        check_against_hf(TappedTarget(lm, [0]), 2e-3)
