"""The draft module against the reference `dflash` package on identical weights and inputs."""

from __future__ import annotations

import json

import pytest
import torch
from reference import dflash_model  # skips the module when the oracle is missing

from dflash_onnx.exporter.models.draft import DraftSpec, draft_attention_mask
from dflash_onnx.exporter.pair import load_draft
from dflash_onnx.exporter.tiny import TinySpec, build_pair
from dflash_onnx.runtime.errors import DFlashError

SHAPES = {
    "gqa1_l1_b2": TinySpec(num_heads=4, num_kv_heads=4, draft_layers=1, block_size=2),
    "gqa2_l2_b4": TinySpec(num_heads=4, num_kv_heads=2, draft_layers=2, block_size=4),
    "gqa4_l3_b8_causal": TinySpec(num_heads=8, num_kv_heads=2, head_dim=8, draft_layers=3, block_size=8,
                                  is_causal=True),
    "b16_sliding": TinySpec(draft_layers=2, block_size=16, sliding_window=5),
    "b16_sliding_noncausal": TinySpec(draft_layers=2, block_size=16, sliding_window=5, is_causal=False),
    "bias_scales_softcap": TinySpec(attention_bias=True, input_embedding_scale=1.7, output_multiplier=0.6,
                                    final_logit_softcapping=3.0, block_size=4, target_layer_ids=[0, 1, 2]),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_draft_matches_reference_first_and_later_calls(name, tmp_path):
    spec = SHAPES[name]
    target_dir, draft_dir = build_pair(spec, tmp_path)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()
    ours = load_draft(draft_dir, target)
    reference = dflash_model.DFlashDraftModel.from_pretrained(str(draft_dir)).eval()
    cache = dflash_model._make_cache(reference.config)
    past = ours.empty_cache()
    torch.manual_seed(1)
    block = spec.block_size
    features = len(spec.target_layer_ids) * spec.hidden_size
    start = 0
    for ctx_len in (5, 3):  # the first call ingests a prompt, the later one a step's accepted tokens
        context = torch.randn(1, ctx_len, features)
        ids = torch.randint(0, spec.vocab_size, (1, block))
        positions = torch.arange(start, start + ctx_len + block)[None]
        with torch.no_grad():
            got_logits, got_ids, got_confidence, *past = ours(ids, context, positions, *past)
            embed = dflash_model._raw_input_embeddings(target, ids, ours.spec.input_embedding_scale)
            hidden = reference(target_hidden=context, noise_embedding=embed, position_ids=positions,
                               past_key_values=cache, use_cache=True)
            want = reference.compute_logits(hidden[:, 1:], dflash_model._output_head(target))
        start += ctx_len
        dflash_model._crop_to(cache, start)
        torch.testing.assert_close(got_logits, want, atol=2e-5, rtol=1e-4)
        assert torch.equal(got_ids, want.argmax(-1))
        torch.testing.assert_close(got_confidence, want.softmax(-1).amax(-1), atol=1e-6, rtol=1e-5)
        assert past[0].shape[1] == start


@pytest.mark.parametrize("queries,keys,causal,window", [(3, 7, True, None), (2, 6, False, 2), (4, 9, True, 3),
                                                        (16, 20, False, 5)])
def test_attention_mask_matches_reference(queries, keys, causal, window):
    q, k = torch.zeros(1, 1, queries, 2), torch.zeros(1, 1, keys, 2)
    want = dflash_model._attention_mask(q, k, is_causal=causal, sliding_window=window)[0, 0]
    assert torch.equal(draft_attention_mask(queries, keys, causal, window), want)


def test_attention_mask_is_none_for_full_bidirectional_attention():
    assert draft_attention_mask(3, 7, is_causal=False, sliding_window=None) is None


def test_a_dflash2_config_missing_its_sizes_is_refused_in_one_line(tmp_path):
    raw = {"num_target_layers": 4, "dflash_config": {"selector_rank": 8, "mask_token_id": 3}}
    with pytest.raises(DFlashError, match="DFlash2 draft's config.json lacks \\['conv_kernel_size'"):
        DraftSpec.from_dict(raw)


def test_missing_and_corrupt_draft_weights(tmp_path):
    target_dir, draft_dir = build_pair(TinySpec(), tmp_path)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(target_dir))
    (draft_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DFlashError, match="damaged or truncated .*no readable header"):
        load_draft(draft_dir, target)
    (draft_dir / "model.safetensors").unlink()
    with pytest.raises(DFlashError, match="no weights \\(\\*.safetensors\\)"):
        load_draft(draft_dir, target)
    (draft_dir / "config.json").write_text("{oops")
    with pytest.raises(DFlashError, match="not valid JSON"):
        DraftSpec.from_dir(draft_dir)


def test_drafts_that_ship_embedding_copies_load_with_the_targets(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    target_dir, draft_dir = build_pair(TinySpec(), tmp_path)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir))
    state = load_file(str(draft_dir / "model.safetensors"))
    state["embed_tokens.weight"] = torch.zeros(96, 64)
    save_file(state, str(draft_dir / "model.safetensors"))
    draft = load_draft(draft_dir, target)
    assert torch.equal(draft.embed_tokens, target.get_input_embeddings().weight)


def test_default_target_layer_ids_follow_reference(tmp_path):
    raw = json.loads(json.dumps({"num_target_layers": 36, "num_hidden_layers": 5, "hidden_size": 64,
                                 "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "dflash_config": {"mask_token_id": 3}}))
    assert DraftSpec.from_dict(raw).target_layer_ids == dflash_model.build_target_layer_ids(36, 5)
