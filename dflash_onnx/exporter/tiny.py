"""Tiny random-weight target/draft pairs in the published on-disk layouts, built in seconds.

Tests build them instead of downloading models, and `dflash-onnx demo` uses one as its embedded
default until a trained demo pair ships. `agree=True` biases target and draft towards one token so
that the draft's proposals are often accepted, giving acceptance lengths across 1..block_size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from dflash_onnx.exporter.models.draft import DFlashDraft, DraftSpec
from dflash_onnx.exporter.models.draft_formats import speculators_config


@dataclass
class TinySpec:
    """Shapes of a tiny pair; the defaults export in seconds."""

    vocab_size: int = 96
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int | None = None
    num_experts: int = 0  # > 0: a mixture-of-experts target (model_type qwen3_moe, or gemma4_text's MoE layers)
    experts_per_token: int = 2
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None  # a shared expert beside the routed ones (Qwen2/3.5-MoE)
    # > 0: a Gated-DeltaNet hybrid (model_type qwen3_5_text): every full_attention_interval-th layer is full
    # attention, the others linear attention with these heads (key heads, value heads) and head size
    full_attention_interval: int = 0
    linear_heads: tuple[int, int] = (2, 4)
    linear_head_dim: int = 8
    conv_kernel: int = 4
    # Gemma 4 (model_type gemma4_text): full-attention layers with their own head size and K/V heads (K reused as V
    # where k_eq_v), the last kv_shared_layers layers reading the K/V of the last earlier layer of their kind, and
    # per-layer input embeddings of this width (0: none)
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    k_eq_v: bool = False
    kv_shared_layers: int = 0
    per_layer_input_size: int = 0
    target_layers: int = 4
    draft_layers: int = 1
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 2])
    block_size: int = 4
    model_type: str = "qwen3"
    is_causal: bool | None = None
    sliding_window: int | None = None
    target_sliding_window: int | None = None
    attention_bias: bool = False
    input_embedding_scale: float | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    tie_embeddings: bool = True
    # the draft's kind (dflash, dflash2, dspark) and config.json layout: z-lab's (a Qwen3 config with
    # dflash_config; not for dspark) or the speculators format; what DFlash2 and DSpark add, with their sizes
    draft_kind: str = "dflash"
    draft_format: str = "zlab"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 8
    selector_top_k: int = 4
    markov_rank: int = 8
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    confidence_with_markov: bool = True
    sample_from_anchor: bool | None = None  # None: the kind's default (DSpark's anchor slot proposes)
    sliding_window_non_causal: bool | None = None  # speculators format; None: the kind's default
    # speculators format, dflash: the draft proposes from this many tokens (a random subset holding the favourite,
    # its head those rows of the target's, with speculators' t2d / d2t maps); None: the whole vocabulary
    draft_vocab_size: int | None = None
    agree: bool = False
    # Scale of every target and draft layer's output projections (o_proj, down_proj) under `agree`: deep random
    # stacks swamp the embedding's bias otherwise (the compute is unchanged, only the values are damped).
    damp_layers: float = 1.0
    favourite_token: int = 7
    # under `agree`: the favourite's weight on the embeddings' shared axis in the target's head; below the default
    # the target emits the favourite only where its context leans that way, so its output varies with the prompt and
    # a draft leaning the same way is accepted for some positions, not all
    favourite_logit: float = 4.0
    # under `agree`, a one-layer dflash draft: its layer set (over the random weights) to propose the favourite at
    # the first N proposing slots of each block and another token at the rest, so that against a target that emits
    # only the favourite it is accepted for exactly N positions per block, tau N + 1 (_accept_first); None: off
    draft_accepts: int | None = None
    eos_token_id: int = 1
    max_positions: int = 1024
    rope_theta: float | None = None  # None: the model type's default
    seed: int = 0
    # written tensor by tensor from meta-device shapes (shaped.py), never holding the model: published sizes
    streamed: bool = False
    # Qwen3.5 (qwen3_5_text, qwen3_5_moe_text): saved in the published multimodal layout
    # (Qwen3_5ForConditionalGeneration: model.language_model.*, a one-block vision tower), which onnxruntime-genai's
    # model builder takes
    multimodal: bool = False
    # gpt-oss, streamed: the experts stored as MXFP4 blocks and scales with the checkpoint's quantization_config, as
    # published
    mxfp4: bool = False
    dtype: str = "float32"  # the checkpoint's dtype (streamed pairs)
    shard_bytes: int = 2 * 1024**3


# Full-size shapes with random weights: for measuring speed and size where no checkpoint can be downloaded; and one
# small pair for trying the commands in seconds (the test suite's kind: 4 layers of width 64, 96 characters).
PRESETS = {
    "tiny-agree": TinySpec(agree=True, tie_embeddings=False, block_size=8, target_layer_ids=[1, 2]),
    "qwen3-0.6b-shaped": TinySpec(vocab_size=151936, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                                  intermediate_size=3072, target_layers=28, draft_layers=1, target_layer_ids=[14],
                                  block_size=16, max_positions=40960),
}
# The same shapes with target and draft biased towards one token (untied head): the draft agrees almost
# always, so DFlash runs at the top of its acceptance range; bench's implied speedup covers lower tau.
PRESETS["qwen3-0.6b-shaped-agree"] = replace(PRESETS["qwen3-0.6b-shaped"], agree=True, tie_embeddings=False,
                                             damp_layers=0.002)
# The same pair with its draft in the speculators format proposing from 32768 of the 151936 tokens (t2d / d2t,
# its own head: models/draft_vocab.py), to measure what the smaller head saves per draft step
PRESETS["qwen3-0.6b-shaped-agree-draft-vocab"] = replace(PRESETS["qwen3-0.6b-shaped-agree"],
                                                         draft_format="speculators", draft_vocab_size=32768)
# Its attention (16 query and 8 K/V heads of 128) on a small body (4 layers of width 256, 1024 tokens): its float16
# export travels to a leased GPU machine in one call, where the 0.6B shape's cannot (sizes: docs/ort.md#cuda)
PRESETS["qwen3-0.6b-attention-agree"] = replace(PRESETS["qwen3-0.6b-shaped-agree"], vocab_size=1024,
                                                hidden_size=256, intermediate_size=384, target_layers=4,
                                                target_layer_ids=[1, 2], max_positions=4096)
# The agree pairs at realistic acceptance (published drafts report tau about 3-8; the agree pair's 15.75 is a best
# case): the same target, which emits only the favourite, and a draft set to propose it at the first N slots of each
# block and another token after them (draft_accepts), so that every DFlash step commits N + 1 tokens whatever the
# prompt and its length; lossless as every pair. tau measured 2026-12-08 with full blocks on 2 held-out-code prompts
# of 160 and of 2048 tokens, 64 new tokens (63 after the first, so tau5's last step commits 3):
#   dflash-onnx bench EXPORT --prompt-tokens 160,2048 --num-prompts 2 --max-new-tokens 64 --verify full
# the same at both lengths (docs/benchmarks.md#presets-at-realistic-acceptance; the int4 export of attention-tau5
# kept 4.85: each set row reads one or two axes)
PRESETS["qwen3-0.6b-shaped-tau3"] = replace(PRESETS["qwen3-0.6b-shaped-agree"], draft_accepts=2)  # tau 3.00
PRESETS["qwen3-0.6b-shaped-tau5"] = replace(PRESETS["qwen3-0.6b-shaped-agree"], draft_accepts=4)  # tau 4.85
PRESETS["qwen3-0.6b-shaped-tau7"] = replace(PRESETS["qwen3-0.6b-shaped-agree"], draft_accepts=6)  # tau 7.00
PRESETS["qwen3-0.6b-attention-tau3"] = replace(PRESETS["qwen3-0.6b-attention-agree"], draft_accepts=2)  # tau 3.00
PRESETS["qwen3-0.6b-attention-tau5"] = replace(PRESETS["qwen3-0.6b-attention-agree"], draft_accepts=4)  # tau 4.85
PRESETS["qwen3-0.6b-attention-tau7"] = replace(PRESETS["qwen3-0.6b-attention-agree"], draft_accepts=6)  # tau 7.00
# The seeds' workloads: Qwen3-4B with its 5-layer Qwen3-4B-DFlash-b16 draft, LLaMA-3.1-8B with z-lab's draft
# (taps as the reference package's build_target_layer_ids gives them), bfloat16 like the published weights.
PRESETS["qwen3-4b-shaped"] = TinySpec(
    vocab_size=151936, hidden_size=2560, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=9728,
    target_layers=36, draft_layers=5, target_layer_ids=[1, 9, 17, 25, 33], block_size=16, max_positions=40960,
    rope_theta=1_000_000.0, tie_embeddings=True, streamed=True, dtype="bfloat16")
# Qwen3.5-4B (Gated-DeltaNet hybrid: 24 linear- and 8 full-attention layers, head_dim 256, partial RoPE) with a
# 5-layer draft tapping layers 1, 8, 15, 22, 29, block 16, as z-lab's Qwen3.5 DFlash drafts are published; the
# target in transformers' text-only layout (the published multimodal checkpoint's text weights load the same way)
PRESETS["qwen3.5-4b-shaped"] = TinySpec(
    model_type="qwen3_5_text", vocab_size=248320, hidden_size=2560, num_heads=16, num_kv_heads=4, head_dim=256,
    intermediate_size=9216, full_attention_interval=4, linear_heads=(16, 32), linear_head_dim=128, conv_kernel=4,
    target_layers=32, draft_layers=5, target_layer_ids=[1, 8, 15, 22, 29], block_size=16, max_positions=262144,
    rope_theta=10_000_000.0, tie_embeddings=True, streamed=True, dtype="bfloat16")
# gpt-oss-20b (24 layers alternating 128-token sliding windows and full attention, 64 heads of 64 with sinks, 32
# experts of 2880 with 4 per token, stored as MXFP4 as published) with a 5-layer draft tapping layers 1, 6, 11, 16,
# 21 (the reference package's build_target_layer_ids for 24 layers), block 16
PRESETS["gpt-oss-20b-shaped"] = TinySpec(
    model_type="gpt_oss", vocab_size=201088, hidden_size=2880, num_heads=64, num_kv_heads=8, head_dim=64,
    intermediate_size=2880, num_experts=32, experts_per_token=4, target_layers=24, draft_layers=5,
    target_layer_ids=[1, 6, 11, 16, 21], block_size=16, target_sliding_window=128, max_positions=131072,
    rope_theta=150_000.0, tie_embeddings=False, streamed=True, dtype="bfloat16", mxfp4=True)
PRESETS["llama3.1-8b-shaped"] = TinySpec(
    model_type="llama", vocab_size=128256, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
    intermediate_size=14336, target_layers=32, draft_layers=5, target_layer_ids=[1, 8, 15, 22, 29], block_size=16,
    max_positions=131072, rope_theta=500_000.0, tie_embeddings=False, streamed=True, dtype="bfloat16")


def _target_config(spec: TinySpec) -> dict:
    config = {
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size or 2 * spec.hidden_size,
        "num_hidden_layers": spec.target_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "max_position_embeddings": spec.max_positions,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": spec.tie_embeddings, "eos_token_id": spec.eos_token_id,
        "bos_token_id": 0, "pad_token_id": 0,
    }
    if spec.rope_theta is not None:
        config["rope_theta"] = spec.rope_theta
    if spec.target_sliding_window is not None:  # hybrid: every other layer slides (Qwen3 / Qwen2 style)
        config["use_sliding_window"] = True
        config["sliding_window"] = spec.target_sliding_window
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(spec.target_layers)]
    if spec.model_type == "gemma4_text":
        config.update(global_head_dim=spec.global_head_dim or spec.head_dim, attention_k_eq_v=spec.k_eq_v,
                      num_kv_shared_layers=spec.kv_shared_layers, hidden_size_per_layer_input=spec.per_layer_input_size,
                      vocab_size_per_layer_input=spec.vocab_size, final_logit_softcapping=spec.final_logit_softcapping,
                      hidden_activation="gelu_pytorch_tanh")
        if spec.global_kv_heads:
            config["num_global_key_value_heads"] = spec.global_kv_heads
        if spec.num_experts:  # Gemma 4's MoE layers: routed experts beside the dense MLP
            config.update(enable_moe_block=True, num_experts=spec.num_experts, top_k_experts=spec.experts_per_token,
                          moe_intermediate_size=spec.moe_intermediate_size or spec.hidden_size)
    elif spec.num_experts:
        config.update(num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
                      moe_intermediate_size=spec.moe_intermediate_size or spec.hidden_size,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        if spec.shared_expert_intermediate_size:
            config["shared_expert_intermediate_size"] = spec.shared_expert_intermediate_size
    if spec.full_attention_interval:
        every = spec.full_attention_interval
        config.update(linear_num_key_heads=spec.linear_heads[0], linear_num_value_heads=spec.linear_heads[1],
                      linear_key_head_dim=spec.linear_head_dim, linear_value_head_dim=spec.linear_head_dim,
                      linear_conv_kernel_dim=spec.conv_kernel,
                      layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                   for i in range(spec.target_layers)])
    if spec.model_type in ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "gemma4_text",
                           "gpt_oss"):
        config["head_dim"] = spec.head_dim
    else:
        config["head_dim"] = spec.hidden_size // spec.num_heads
    return config


def _speculators_config(spec: TinySpec) -> dict:
    """The draft's config.json in the speculators format."""
    kind = spec.draft_kind
    heads = {}
    if kind == "dflash2":
        heads = dict(conv_kernel_size=spec.conv_kernel_size, conv_group_size=spec.conv_group_size,
                     selector_rank=spec.selector_rank, selector_top_k=spec.selector_top_k)
    if kind == "dspark":
        heads = dict(markov_rank=spec.markov_rank, markov_head_type=spec.markov_head_type,
                     enable_confidence_head=spec.confidence_head,
                     confidence_head_with_markov=spec.confidence_with_markov)
    from_anchor = kind == "dspark" if spec.sample_from_anchor is None else spec.sample_from_anchor
    non_causal = kind == "dflash2" if spec.sliding_window_non_causal is None else spec.sliding_window_non_causal
    raw = speculators_config(_zlab_config(spec), kind, heads, from_anchor, non_causal)
    if spec.draft_vocab_size is not None:
        raw["draft_vocab_size"] = spec.draft_vocab_size
    return raw


def _draft_tokens(spec: TinySpec) -> np.ndarray:
    """The target ids a reduced-vocabulary draft proposes from: a random sorted subset holding the favourite."""
    rng = np.random.default_rng(spec.seed + 2)
    others = np.setdiff1d(np.arange(spec.vocab_size), [spec.favourite_token])
    chosen = rng.choice(others, spec.draft_vocab_size - 1, replace=False)
    return np.sort(np.append(chosen, spec.favourite_token)).astype(np.int64)


def _draft_config(spec: TinySpec) -> dict:
    if spec.draft_format == "speculators":
        return _speculators_config(spec)
    if spec.draft_kind == "dspark":
        raise ValueError("DSpark drafts are written in the speculators format: draft_format='speculators'")
    config = _zlab_config(spec)
    if spec.draft_kind == "dflash2":
        config["architectures"] = ["DFlash2DraftModel"]
        config["dflash_config"].update(conv_kernel_size=spec.conv_kernel_size, conv_group_size=spec.conv_group_size,
                                       selector_rank=spec.selector_rank, selector_top_k=spec.selector_top_k)
    return config


def _zlab_config(spec: TinySpec) -> dict:
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size or 2 * spec.hidden_size,
        "num_hidden_layers": spec.draft_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_positions,
        "rms_norm_eps": 1e-6, "attention_bias": spec.attention_bias, "num_target_layers": spec.target_layers,
        "rope_theta": spec.rope_theta or 10000.0, "tie_word_embeddings": False,
        "dflash_config": {"target_layer_ids": spec.target_layer_ids, "block_size": spec.block_size,
                          "mask_token_id": spec.vocab_size - 1},
    }
    if spec.is_causal is not None:
        config["is_causal"] = spec.is_causal
    if spec.sliding_window is not None:
        config["sliding_window"] = spec.sliding_window
        config["use_sliding_window"] = True
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(spec.draft_layers)]
    for key in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
        if getattr(spec, key) is not None:
            config["dflash_config"][key] = getattr(spec, key)
    return config


# a ChatML-like template in plain characters, which the character tokenizer spells out: chat requests work on any
# preset pair (the model is random; the template only shapes the prompt as chat models' do)
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_chat_template(directory: Path) -> None:
    """tokenizer_config.json with CHAT_TEMPLATE (kept beside whatever else the file holds)."""
    path = Path(directory) / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}, indent=2))


def write_char_tokenizer(directory: Path, vocab_size: int) -> None:
    """A character-level tokenizer.json for a tiny vocab: <pad>=0, <eos>=1, printable ASCII, <mask> last."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)][: vocab_size - 3]
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}, "<mask>": vocab_size - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(["<pad>", "<eos>", "<mask>"])
    tokenizer.save(str(Path(directory) / "tokenizer.json"))


def build_target(spec: TinySpec, directory: Path):
    """Random-weight HF causal LM saved with save_pretrained; returns the model."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(spec.seed)
    config = AutoConfig.for_model(spec.model_type, **_target_config(spec))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if spec.agree:
        _bias_towards(model, spec)
    (_multimodal(model, spec) if spec.multimodal else model).save_pretrained(str(directory))
    write_char_tokenizer(directory, spec.vocab_size)
    return model


# the smallest vision tower Qwen3.5's multimodal classes build (the text model never reads it)
TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
               "patch_size": 8, "temporal_patch_size": 2, "spatial_merge_size": 2}


def _multimodal(model, spec: TinySpec):
    """The text model `model` inside Qwen3.5's published multimodal class, its text weights the same tensors."""
    import transformers

    names = {"qwen3_5_text": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
             "qwen3_5_moe_text": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration")}
    if spec.model_type not in names:
        raise ValueError(f"multimodal=True is for Qwen3.5 targets ({', '.join(names)}), not {spec.model_type}")
    config_class, model_class = (getattr(transformers, name) for name in names[spec.model_type])
    text = {k: v for k, v in model.config.to_dict().items() if k not in ("architectures", "model_type")}
    composite = model_class(config_class(text_config=text, vision_config=TINY_VISION,
                                         tie_word_embeddings=spec.tie_embeddings)).eval()
    composite.model.language_model.load_state_dict(model.model.state_dict())
    composite.lm_head.load_state_dict(model.lm_head.state_dict())
    return composite


def _bias_towards(model, spec: TinySpec) -> None:
    """Give every embedding a positive component on one axis and read it out as the favourite token."""
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed[:, 0] = embed[:, 0].abs() + 0.05
        head = model.get_output_embeddings().weight
        if head.data_ptr() != embed.data_ptr():
            head[spec.favourite_token, 0] = spec.favourite_logit
        if spec.damp_layers != 1.0:
            for name, param in model.named_parameters():
                if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")):
                    param.mul_(spec.damp_layers)


def build_draft(spec: TinySpec, directory: Path, target) -> None:
    """Random draft body in a published layout (config.json, z-lab's or speculators', + model.safetensors)."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = _draft_config(spec)
    draft_spec = DraftSpec.from_dict(raw)
    tokens = _draft_tokens(spec) if spec.draft_vocab_size is not None else None
    if tokens is not None:
        draft_spec = replace(draft_spec, draft_to_target=tokens)
    draft = DFlashDraft(draft_spec, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    torch.manual_seed(spec.seed + 1)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name in ("embed_tokens", "lm_head"):
                continue
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.05)
            if name.endswith("base_kernel"):  # DFlash2's convolutions: near the identity they start from
                param[:, 0] += 1.0
            if name.endswith(("predecessor_codebook", "successor_codebook", "markov_w1.weight")) and not spec.agree:
                param.normal_(0.0, 1.0)  # large enough to reorder the candidates now and then
        if spec.agree:
            draft.norm.weight[0] = 8.0
            if spec.markov_rank and spec.draft_kind == "dspark":  # the Markov bias leans to the favourite too
                draft.markov_head.markov_w1.weight[:, 0] = 1.0
                favourite = spec.favourite_token if tokens is None else int(np.searchsorted(tokens,
                                                                                              spec.favourite_token))
                draft.markov_head.markov_w2.weight[favourite, 0] = 4.0
            for name, param in draft.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    param.mul_(spec.damp_layers)
        if spec.draft_accepts is not None:
            _accept_first(draft, spec)
    state = {k: v.contiguous() for k, v in draft.state_dict().items() if k not in ("embed_tokens", "lm_head")}
    if tokens is not None:  # speculators' maps and the reduced head it serializes
        mask = torch.zeros(spec.vocab_size, dtype=torch.bool)
        mask[torch.from_numpy(tokens)] = True
        state.update(t2d=mask, d2t=torch.from_numpy(tokens - np.arange(len(tokens))),
                     **{"lm_head.weight": target.get_output_embeddings().weight.detach()[tokens].clone()})
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(raw, indent=2))


def _accept_first(draft: DFlashDraft, spec: TinySpec) -> None:
    """Set the draft's layer so that, after a favourite anchor, it proposes the favourite at slots 1..N of the
    block (N = spec.draft_accepts) and another token at the later ones. One head reads the anchor: the mask
    token's query and the favourite's key meet in one RoPE pair at an angle that crosses zero between slots N and
    N + 1, an offset inside the block that no context length moves; the anchor's value, written against the
    favourite's axis, lifts that axis's logit only where the head attends to the anchor, since the final norm flips
    its sign (the mask token alone leans away from the favourite). The mask token's key lies on an axis the query
    lacks; the context's keys (fc writes the tapped hidden states' first axis, positive under `agree`, on one axis)
    lie in the slowest RoPE pair opposite the query, far below the anchor up to ~10k positions. Every set row reads
    one or two input axes, so that weight quantization (int4, int8) keeps it; the other heads and the MLP write
    nothing."""
    k, block = spec.draft_accepts, spec.block_size
    if not (spec.agree and spec.draft_kind == "dflash" and spec.draft_layers == 1 and spec.sliding_window is None
            and spec.draft_vocab_size is None and 1 <= k <= block - 2):
        raise ValueError("draft_accepts is set for an agree pair's one-layer, full-attention dflash draft, "
                         f"1 <= draft_accepts <= block_size - 2 (got {k} at block {block})")
    layer, config = draft.layers[0], draft.spec.config
    attn, width, half = layer.self_attn, config.hidden_size, layer.self_attn.head_dim // 2
    embed = draft.embed_tokens.detach().double() * draft.spec.input_embedding_scale
    normed = embed / torch.sqrt(embed.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)  # the input norm's
    mask, favourite = normed[spec.vocab_size - 1], normed[spec.favourite_token]
    context = 1 + int(torch.argmin((mask.abs() + favourite.abs())[1:]))  # the axis fc writes: both tokens small
    # the anchor's feature, 0 for the mask token: two axes in different halves of the width (so in different
    # quantization blocks), the pair whose feature is largest for the favourite against the weights it needs
    low, high = torch.arange(1, width // 2), torch.arange(width // 2, width)
    low, high = low[low != context], high[high != context]
    feature = mask[high][None, :] * favourite[low][:, None] - mask[low][:, None] * favourite[high][None, :]
    best = int(torch.argmax(feature.abs() / (mask[low][:, None].abs() + mask[high][None, :].abs())))
    first, second = int(low[best // len(high)]), int(high[best % len(high)])
    row = torch.zeros(width, dtype=torch.float64)
    row[first], row[second] = mask[second], -mask[first]
    row /= row @ favourite  # 1 for the favourite, 0 for the mask token
    inv_freq = draft.rotary_emb.inv_freq.double()
    bound = 0.85 * math.pi / max(block - 1.5 - k, k - 0.5)  # one angle's sweep over the block stays in a half turn
    pair = int(torch.nonzero(inv_freq < bound)[0])
    slow = int(torch.argmin(inv_freq))
    floor = next(i for i in range(half) if i not in (pair, slow))  # a pair no query reads
    theta = float(inv_freq[pair])
    phase = math.pi / 2 - theta * (k + 0.5)  # the anchor's score S cos(theta j + phase) is 0 at slot k + 0.5
    # the favourite's key: 1 on `pair`, and on `floor` (which no query reads) half the mask token's there
    floor_weight = 0.5 / float(mask[0])
    share = 1 / math.sqrt(1 + (floor_weight * float(favourite[0])) ** 2)  # of the anchor's key on `pair`
    reach = math.sqrt(half)  # each of the query's two parts after its norm
    anchor_score = (20 + math.log(block)) / math.sin(theta / 2)  # 20 above the block's other keys at the cut
    for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp.down_proj, draft.fc):
        module.weight.zero_()
    attn.q_proj.weight[pair, 0] = math.cos(phase) / float(mask[0])  # the mask token's query, read off axis 0
    attn.q_proj.weight[pair + half, 0] = math.sin(phase) / float(mask[0])
    attn.q_proj.weight[slow, 0] = 1 / float(mask[0])
    attn.k_proj.weight[pair] = row.float()
    attn.k_proj.weight[floor, 0] = floor_weight  # every token's axis 0 is positive under `agree`
    attn.k_proj.weight[slow, context] = -1 / math.sqrt(width)  # the context's key: -1 on `slow`
    attn.v_proj.weight[0] = row.float()
    attn.o_proj.weight[0, 0] = -1.0
    attn.q_norm.weight.fill_(1.0)
    attn.k_norm.weight.fill_(1.0)
    attn.k_norm.weight[pair] = anchor_score / (reach * share)
    attn.k_norm.weight[slow] = 100.0 / reach
    draft.fc.weight[context, 0] = 100.0
    draft.norm.weight[0] = -8.0


def build_pair(spec: TinySpec, root: Path, progress: bool = False) -> tuple[Path, Path]:
    """Write ROOT/target and ROOT/draft; return both paths."""
    root = Path(root)
    target_dir, draft_dir = root / "target", root / "draft"
    if spec.mxfp4 and not spec.streamed:
        raise ValueError("mxfp4=True is written by the streamed writer: set streamed=True")
    if spec.draft_vocab_size is not None and (spec.streamed or spec.draft_format != "speculators"
                                              or spec.draft_kind not in ("dflash", "dspark")):
        raise ValueError("draft_vocab_size is written for in-memory speculators-format dflash and dspark drafts only")
    if spec.streamed:
        _write_streamed(spec, target_dir, draft_dir, progress)
        return target_dir, draft_dir
    from dflash_onnx.artifacts.progress import Stages

    stages = Stages(2, enabled=progress)
    with stages.stage(f"target: {spec.target_layers} layers of random weights, saved to {target_dir}"):
        target = build_target(spec, target_dir)
    with stages.stage(f"draft: {spec.draft_layers} layer{'s' if spec.draft_layers != 1 else ''}, saved to "
                      f"{draft_dir}"):
        build_draft(spec, draft_dir, target)
    return target_dir, draft_dir


# gpt-oss's MXFP4 experts and the quantization_config its checkpoints carry (the rest stays bfloat16)
MXFP4_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def _write_streamed(spec: TinySpec, target_dir: Path, draft_dir: Path, progress: bool) -> None:
    """A published-size pair, one safetensors shard in memory at a time (shaped.py)."""
    import sys

    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from dflash_onnx.exporter.shaped import draft_shapes, target_shapes, write_checkpoint

    if spec.agree:
        raise ValueError("streamed pairs are plain random weights: agree=True needs the whole model (build_target)")
    if spec.mxfp4 and spec.model_type != "gpt_oss":
        raise ValueError(f"mxfp4=True stores gpt-oss's experts, not {spec.model_type}'s")
    config = AutoConfig.for_model(spec.model_type, **_target_config(spec), torch_dtype=spec.dtype)
    draft_config = {**_draft_config(spec), "torch_dtype": spec.dtype}
    target_tensors = target_shapes(config)
    packed = {name for name in target_tensors if name.endswith(MXFP4_EXPERTS)} if spec.mxfp4 else set()
    if packed:
        config.quantization_config = MXFP4_CONFIG
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[spec.model_type]]  # as published configs name it
    for directory, shapes, seed, mxfp4 in ((target_dir, target_tensors, spec.seed, packed),
                                           (draft_dir, draft_shapes(draft_config), spec.seed + 1, set())):
        directory.mkdir(parents=True, exist_ok=True)
        for file in write_checkpoint(directory, shapes, spec.dtype, seed, spec.shard_bytes, mxfp4=mxfp4):
            if progress:
                print(f"wrote {directory / file}", file=sys.stderr, flush=True)
    config.save_pretrained(str(target_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(target_dir))
    write_char_tokenizer(target_dir, spec.vocab_size)
    (draft_dir / "config.json").write_text(json.dumps(draft_config, indent=2))


def preset_sizes(spec: TinySpec) -> tuple[int, int]:
    """(target, draft body) parameter counts of a preset, from its shapes (nothing allocated); the draft's in
    z-lab's layout (a speculators-format draft with its own head adds that head)."""
    from transformers import AutoConfig

    from dflash_onnx.exporter.shaped import draft_shapes, target_shapes

    config = AutoConfig.for_model(spec.model_type, **_target_config(spec))
    count = lambda shapes: sum(int(np.prod(shape)) for shape in shapes.values())  # noqa: E731
    return count(target_shapes(config)), count(draft_shapes(_zlab_config(spec)))


def _preset_list() -> str:
    """The presets with their sizes, for --help."""
    lines = ["presets (parameters; on disk float32, or bfloat16 for the streamed ones, gpt-oss's experts less in "
             "MXFP4):"]
    for name, spec in PRESETS.items():
        target, draft = preset_sizes(spec)
        size = (target + draft) * (2 if spec.dtype == "bfloat16" else 4) / 2**30
        lines.append(f"  {name:<36} target {target / 1e6:8.2f}M, draft {draft / 1e6:7.2f}M, {size:6.2f} GiB, "
                     f"{spec.target_layers} layers, vocab {spec.vocab_size}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """python -m dflash_onnx.exporter.tiny --preset NAME --out DIR: a random-weight target and DFlash draft in
    DIR/target and DIR/draft (Hugging Face layout, a character tokenizer and a chat template), to try the commands
    on or to measure speed and size at a published model's shape."""
    import argparse
    import sys
    import time

    helping = any(arg in ("-h", "--help") for arg in (sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(prog="python -m dflash_onnx.exporter.tiny", description=main.__doc__,
                                     epilog=_preset_list() if helping else None,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), required=True, metavar="NAME",
                        help="one of the presets below; tiny-agree builds in seconds")
    parser.add_argument("--out", type=Path, required=True, help="directory to write target/ and draft/ into")
    args = parser.parse_args(argv)
    spec = PRESETS[args.preset]
    target, draft = preset_sizes(spec)
    print(f"building {args.preset}: target {target / 1e6:.1f}M and draft {draft / 1e6:.1f}M parameters of random "
          "weights ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    target_dir, draft_dir = build_pair(spec, args.out, progress=True)
    write_chat_template(target_dir)
    print(f"wrote {target_dir} and {draft_dir} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
