"""Published-size presets written tensor by tensor: sharded checkpoints that HF, the reference package and our
export load unchanged (checked here on a small shape written the same way)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dflash_onnx.exporter.export import export_pair
from dflash_onnx.exporter.shaped import draft_shapes, write_checkpoint
from dflash_onnx.exporter.tiny import PRESETS, TinySpec, _draft_config, build_pair
from dflash_onnx.targets import open_decoder

GPT_OSS_20B = 20_914_757_184  # 24 layers of 32 experts: 19.11 B of it in experts

SMALL = TinySpec(vocab_size=96, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, target_layers=4,
                 draft_layers=2, target_layer_ids=[1, 2], block_size=4, tie_embeddings=True, streamed=True,
                 dtype="bfloat16", shard_bytes=64 * 1024)


@pytest.fixture(scope="module")
def streamed_pair(tmp_path_factory):
    return build_pair(SMALL, tmp_path_factory.mktemp("shaped"))


def test_streamed_checkpoints_are_sharded_with_an_index_and_load_strictly(streamed_pair):
    target_dir, draft_dir = streamed_pair
    index = json.loads((target_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((target_dir / s).exists() for s in shards)
    assert all(v.dtype == torch.bfloat16 for s in shards for v in load_file(str(target_dir / s)).values())
    model, info = AutoModelForCausalLM.from_pretrained(str(target_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.tie_word_embeddings and "lm_head.weight" not in index["weight_map"]
    stored = {k: v for s in shards for k, v in load_file(str(target_dir / s)).items()}
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in stored.values())
    assert set(stored) == set(index["weight_map"])
    draft_files = sorted(p.name for p in draft_dir.glob("*.safetensors"))
    draft = {k: v for f in draft_files for k, v in load_file(str(draft_dir / f)).items()}
    assert set(draft) == set(draft_shapes(json.loads((draft_dir / "config.json").read_text())))


def test_a_tensor_depends_on_its_name_and_seed_only(tmp_path):
    shapes = {"a.weight": (3, 5), "b.norm.weight": (5,), "c.weight": (2, 4)}
    list(write_checkpoint(tmp_path, shapes, "float16", seed=4, shard_bytes=1 << 20))
    one = load_file(str(tmp_path / "model.safetensors"))
    other = tmp_path / "other"
    other.mkdir()
    list(write_checkpoint(other, {"c.weight": (2, 4)}, "float16", seed=4, shard_bytes=1 << 20))
    assert torch.equal(load_file(str(other / "model.safetensors"))["c.weight"], one["c.weight"])
    assert torch.equal(one["b.norm.weight"], torch.ones(5, dtype=torch.float16))
    assert 0.005 < float(one["a.weight"].float().std()) < 0.05


def test_a_streamed_pair_exports_and_decodes_hf_greedy(streamed_pair, tmp_path):
    """The bfloat16 sharded pair exports (float32) and DFlash produces the target's HF greedy tokens."""
    target_dir, draft_dir = streamed_pair
    export_pair(target_dir, draft_dir, tmp_path / "out", progress=False)
    decoder = open_decoder(tmp_path / "out")
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    for prompt in ([5, 9, 12, 40], [3, 3, 70]):
        ids = torch.tensor(prompt)[None]
        want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert decoder.generate(prompt, 12, "dflash", stop_token_ids=[]).tokens == want


@pytest.mark.parametrize("name", ["qwen3-4b-shaped", "llama3.1-8b-shaped", "gpt-oss-20b-shaped"])
def test_published_presets_have_the_published_shapes(name):
    """Parameter counts from the meta-device shapes (nothing allocated): Qwen3-4B 4.02 B, LLaMA-3.1-8B 8.03 B,
    gpt-oss-20b 20.91 B (OpenAI's model card: 21 B)."""
    from transformers import AutoConfig

    from dflash_onnx.exporter.shaped import target_shapes
    from dflash_onnx.exporter.tiny import _target_config

    spec = PRESETS[name]
    config = AutoConfig.for_model(spec.model_type, **_target_config(spec))
    count = sum(int(np.prod(s)) for s in target_shapes(config).values())
    assert count == {"qwen3-4b-shaped": 4_022_468_096, "llama3.1-8b-shaped": 8_030_261_248,
                     "gpt-oss-20b-shaped": GPT_OSS_20B}[name]
    draft = draft_shapes(_draft_config(spec))
    assert draft["fc.weight"] == (spec.hidden_size, 5 * spec.hidden_size)
    assert sum(k.endswith("q_proj.weight") for k in draft) == 5


def test_streamed_pairs_refuse_agree_and_mxfp4_outside_gpt_oss():
    with pytest.raises(ValueError, match="agree"):
        build_pair(replace(SMALL, agree=True), "/nonexistent")
    with pytest.raises(ValueError, match="gpt-oss"):
        build_pair(replace(SMALL, mxfp4=True), "/nonexistent")
    with pytest.raises(ValueError, match="streamed=True"):
        build_pair(replace(SMALL, mxfp4=True, streamed=False), "/nonexistent")
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_pair(replace(SMALL, draft_format="speculators", draft_vocab_size=32), "/nonexistent")


def test_a_streamed_gpt_oss_pair_stores_its_experts_as_mxfp4_and_decodes_hf_greedy(tmp_path):
    """The gpt-oss-20b-shaped preset's layout at a tiny shape: experts written as MXFP4 blocks and scales with the
    checkpoint's quantization_config (never as bfloat16), which transformers dequantizes when it loads them and our
    streamed export dequantizes tensor by tensor; DFlash gives HF greedy's tokens."""
    spec = replace(PRESETS["gpt-oss-20b-shaped"], vocab_size=96, hidden_size=64, num_heads=4, num_kv_heads=2,
                   head_dim=16, intermediate_size=64, num_experts=4, experts_per_token=2, target_layers=4,
                   draft_layers=1, target_layer_ids=[1, 2], block_size=4, target_sliding_window=5,
                   shard_bytes=64 * 1024)
    target_dir, draft_dir = build_pair(spec, tmp_path)
    index = json.loads((target_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert json.loads((target_dir / "config.json").read_text())["architectures"] == ["GptOssForCausalLM"]
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in index
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in index)
    scales = load_file(str(target_dir / index["model.layers.0.mlp.experts.down_proj_scales"]))
    assert scales["model.layers.0.mlp.experts.down_proj_scales"].dtype == torch.uint8
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    experts = target.model.layers[0].mlp.experts.gate_up_proj
    assert experts.shape == (4, 64, 128) and 0.005 < float(experts.std()) < 0.05  # dequantized on load
    export_pair(target_dir, draft_dir, tmp_path / "out", progress=False)
    decoder = open_decoder(tmp_path / "out")
    for prompt in ([5, 9, 12, 40], [3, 3, 70]):
        ids = torch.tensor(prompt)[None]
        want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert decoder.generate(prompt, 12, "dflash", stop_token_ids=[], verify="full").tokens == want
