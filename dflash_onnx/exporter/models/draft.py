"""The DFlash draft model in PyTorch, faithful to the reference `dflash` package (0.1.0).

Written for export: context K/V are explicit tensors ([batch, seq, kv_heads, head_dim]) instead of
a cache object, the attention mask is built from shapes, and the target's embedding and lm_head are
parameters of this module so that the exported draft graph is self-contained.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from dflash_onnx.artifacts.model_dirs import read_config, weight_files
from dflash_onnx.exporter.models.draft_formats import DFLASH2_KEYS, speculators_fields
from dflash_onnx.exporter.models.draft_heads import (
    CandidateSelector,
    ConfidenceHead,
    GroupedDynamicCausalConv,
    MarkovHead,
)
from dflash_onnx.exporter.models.draft_vocab import HEAD_KEY, MAP_KEYS, read_draft_to_target, spread, target_columns
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.runners import ARGMAX_PROBABILITY


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default tapped layers when a checkpoint names none (the reference's rule)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DraftSpec:
    """The facts of a draft checkpoint, read from its config.json: z-lab's layout (a Qwen3 config with a
    `dflash_config`: DFlash and DFlash2) or the speculators format (`speculators_model_type` dflash, dflash2 or
    dspark: draft_formats.py)."""

    config: Qwen3Config
    target_layer_ids: list[int]  # decoder layers whose outputs the draft reads (z-lab's numbering)
    block_size: int
    mask_token_id: int | None
    num_target_layers: int | None  # None: the checkpoint does not say (speculators: the target's, at pairing)
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    kind: str = "dflash"  # dflash, dflash2 or dspark
    conv_kernel_size: int = 0  # DFlash2's convolutions and candidate selector
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    markov_rank: int = 0  # DSpark's Markov head (0: none) and confidence head
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_with_markov: bool = False
    sample_from_anchor: bool = False  # the anchor's slot proposes too: block_size proposals, not block_size - 1
    sliding_causal: bool = True  # a sliding layer's block queries see only the slots up to their own
    window_from_anchor: bool = False  # a sliding layer's window counts back from the anchor, not from each query
    layout: str = "zlab"  # the config.json's layout: zlab or speculators
    draft_vocab: int | None = None  # tokens a reduced-vocabulary draft proposes from (draft_vocab.py); None: all
    # each draft token's target id, read from the checkpoint (d2t / t2d) by from_dir where draft_vocab is set
    draft_to_target: np.ndarray | None = field(default=None, compare=False, repr=False)

    def proposals(self, block_size: int) -> int:
        """Tokens one draft call proposes with a block of `block_size` slots."""
        return block_size if self.sample_from_anchor else block_size - 1

    @classmethod
    def from_dict(cls, raw: dict) -> DraftSpec:
        if "speculators_model_type" in raw:
            return cls(**speculators_fields(raw))
        dflash = dict(raw.get("dflash_config") or {})
        architectures = raw.get("architectures") or []
        dflash2 = any("DFlash2" in a for a in architectures) or any(k in dflash or k in raw for k in DFLASH2_KEYS)
        if "num_target_layers" not in raw:
            raise DFlashError("draft config.json has no 'num_target_layers': is this a DFlash draft directory?")
        try:
            config = Qwen3Config(**{k: v for k, v in raw.items() if k != "dflash_config"})

            def value(name, default=None):
                return dflash.get(name, raw.get(name, default))

            if dflash2 and any(value(k) is None for k in DFLASH2_KEYS):
                missing = [k for k in DFLASH2_KEYS if value(k) is None]
                raise DFlashError(f"this DFlash2 draft's config.json lacks {missing}")
            layer_ids = value("target_layer_ids") or build_target_layer_ids(
                int(raw["num_target_layers"]), config.num_hidden_layers
            )
            softcap = value("final_logit_softcapping")
            mask = value("mask_token_id")
            return cls(
                config=config,
                target_layer_ids=[int(i) for i in layer_ids],
                block_size=int(value("block_size", 16)),
                mask_token_id=None if mask is None else int(mask),
                num_target_layers=int(raw["num_target_layers"]),
                input_embedding_scale=float(value("input_embedding_scale", 1.0)),
                output_multiplier=float(value("output_multiplier", 1.0)),
                final_logit_softcapping=None if softcap is None or float(softcap) <= 0 else float(softcap),
                kind="dflash2" if dflash2 else "dflash",
                **({k: int(value(k)) for k in DFLASH2_KEYS} if dflash2 else {}),
            )
        except (TypeError, ValueError) as exc:  # a field of the wrong type or shape
            raise DFlashError(f"draft config.json cannot describe a DFlash draft: {exc}") from None

    @classmethod
    def from_dir(cls, path: Path) -> DraftSpec:
        spec = cls.from_dict(read_config(Path(path), "draft"))
        if spec.draft_vocab is None:
            return spec
        return replace(spec, draft_to_target=read_draft_to_target(Path(path), spec.draft_vocab,
                                                                  spec.config.vocab_size))


def confidence(logits: torch.Tensor) -> torch.Tensor:
    """The probability of each row's argmax, computed in float32: what the verify policy reads per proposed
    token (greedy decoding moves these B-1 floats to the host, never the logits)."""
    return torch.softmax(logits.float(), dim=-1).amax(dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] with cos/sin [batch, seq, head_dim]."""
    return x * cos[:, :, None, :] + _rotate_half(x) * sin[:, :, None, :]


def visible(query_pos: torch.Tensor, key_pos: torch.Tensor, is_causal: bool, window: int | None,
            anchor_pos: torch.Tensor | None = None) -> torch.Tensor:
    """DFlash's attention rule on absolute positions (broadcasting query_pos [..., Q, 1] against key_pos
    [..., 1, K]): causal layers see keys up to the query, sliding layers keys less than `window` away; with
    `anchor_pos` (the speculators convention) the window counts back from the block's anchor instead, reaching
    the `window` keys before it."""
    distance = query_pos - key_pos
    conditions = [distance >= 0] if is_causal else []
    if window is not None and anchor_pos is not None:
        conditions.append(anchor_pos - key_pos <= window)
    elif window is not None:
        conditions.append(distance < window)
        if not is_causal:
            conditions.append(-distance < window)
    mask = conditions[0] if conditions else distance == distance  # all true, built from a comparison (CoreML)
    for condition in conditions[1:]:
        mask = mask & condition
    return mask


def draft_attention_mask(
    num_queries: int, num_keys: int, is_causal: bool, sliding_window: int | None, device=None,
    window_from_anchor: bool = False,
) -> torch.Tensor | None:
    """Which keys each block query sees; the queries are the last `num_queries` key positions, the first of
    them the anchor."""
    if not is_causal and sliding_window is None:
        return None
    anchor = num_keys - num_queries
    query_pos = anchor + torch.arange(num_queries, device=device)[:, None]
    return visible(query_pos, torch.arange(num_keys, device=device)[None, :], is_causal, sliding_window,
                   torch.tensor(anchor, device=device) if window_from_anchor else None)


class DraftAttention(nn.Module):
    """Queries from the block; keys/values from [past context ; new context ; block]."""

    def __init__(self, config: Qwen3Config, layer_idx: int, sliding_causal: bool = True,
                 window_from_anchor: bool = False):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None)
        layer_type = layer_types[layer_idx] if layer_types else "full_attention"
        is_causal = getattr(config, "is_causal", None)
        sliding = layer_type == "sliding_attention"
        self.is_causal = sliding and sliding_causal if is_causal is None else bool(is_causal)
        self.sliding_window = config.sliding_window if sliding else None
        self.window_from_anchor = window_from_anchor

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], heads, self.head_dim)

    def forward(self, block, context, cos, sin, past_key, past_value, mask: torch.Tensor | None = None):
        """`mask` [queries, keys] overrides the inference rule (training packs many blocks in one call)."""
        ctx_len = context.shape[1]
        cos_ctx, sin_ctx = cos[:, :ctx_len], sin[:, :ctx_len]
        cos_blk, sin_blk = cos[:, ctx_len:], sin[:, ctx_len:]
        q = _rope(self.q_norm(self._heads(self.q_proj(block), self.num_heads)), cos_blk, sin_blk)
        k_ctx = _rope(self.k_norm(self._heads(self.k_proj(context), self.num_kv_heads)), cos_ctx, sin_ctx)
        k_blk = _rope(self.k_norm(self._heads(self.k_proj(block), self.num_kv_heads)), cos_blk, sin_blk)
        v_ctx = self._heads(self.v_proj(context), self.num_kv_heads)
        v_blk = self._heads(self.v_proj(block), self.num_kv_heads)
        present_key = torch.cat([past_key, k_ctx], dim=1)
        present_value = torch.cat([past_value, v_ctx], dim=1)
        keys = torch.cat([present_key, k_blk], dim=1).transpose(1, 2)
        values = torch.cat([present_value, v_blk], dim=1).transpose(1, 2)
        if mask is None:
            mask = draft_attention_mask(q.shape[1], keys.shape[2], self.is_causal, self.sliding_window, q.device,
                                        self.window_from_anchor)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, scale=self.head_dim**-0.5,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        out = out.transpose(1, 2).reshape(block.shape[0], block.shape[1], -1)
        return self.o_proj(out), present_key, present_value


def _per_block(x: torch.Tensor, block_size: int | None) -> torch.Tensor:
    """[1, K*B, H] packed blocks -> [K, B, H] (unchanged without block_size)."""
    return x.reshape(-1, block_size, x.shape[-1]) if block_size else x


SAMPLED_INPUTS = ["sample_uniform", "sample_temperature"]


class DraftLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int, spec: DraftSpec | None = None):
        super().__init__()
        self.self_attn = DraftAttention(config, layer_idx, *((spec.sliding_causal, spec.window_from_anchor)
                                                             if spec else ()))
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if spec is not None and spec.kind == "dflash2":  # DFlash2: both sublayers inside a dynamic convolution
            self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, spec.conv_kernel_size,
                                                           spec.conv_group_size)
            self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, spec.conv_kernel_size,
                                                     spec.conv_group_size)

    def forward(self, hidden, context, cos, sin, past_key, past_value, mask: torch.Tensor | None = None,
                block_size: int | None = None):
        """The block's hidden states; only the block's rows pass the convolutions, never the context's.
        `block_size`: hidden holds many blocks packed in one row (training), each convolved on its own."""
        present: list[torch.Tensor] = []

        def attend(normed: torch.Tensor) -> torch.Tensor:
            out, key, value = self.self_attn(normed, context, cos, sin, past_key, past_value, mask)
            present.extend((key, value))
            return out

        hidden = self.around(hidden, attend, block_size)
        return hidden, present[0], present[1]

    def around(self, hidden: torch.Tensor, attend, block_size: int | None = None) -> torch.Tensor:
        """The layer's residual body around `attend(normed) -> attention output`, DFlash2's convolutions
        included: the graph forms that keep K/V their own way (retained, stateful) pass their attention here."""
        convolved = hasattr(self, "attention_conv")
        normed = self.input_layernorm(hidden)
        packed = (lambda x: x.reshape(hidden.shape)) if block_size else (lambda x: x)  # no traced shape otherwise
        if convolved:
            normed, delta = self.attention_conv.prepare(_per_block(normed, block_size))
            normed = packed(normed)
        attn = attend(normed)
        if convolved:
            attn = packed(self.attention_conv.finish(_per_block(attn, block_size), delta))
        hidden = hidden + attn
        normed = self.post_attention_layernorm(hidden)
        if convolved:
            normed, delta = self.mlp_conv.prepare(_per_block(normed, block_size))
            normed = packed(normed)
        out = self.mlp(normed)
        if convolved:
            out = packed(self.mlp_conv.finish(_per_block(out, block_size), delta))
        return hidden + out


class DFlashDraft(nn.Module):
    """Draft body (checkpoint weights) plus the target's embedding and lm_head (shared weights)."""

    def __init__(self, spec: DraftSpec, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        config = spec.config
        self.spec = spec
        self.layers = nn.ModuleList(DraftLayer(config, i, spec) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(spec.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.embed_tokens = nn.Parameter(embed_weight, requires_grad=False)
        vocab, width = config.vocab_size, config.hidden_size
        if spec.draft_vocab is None:
            self.lm_head = nn.Parameter(lm_head_weight, requires_grad=False)
        else:  # its own reduced head, from its checkpoint; proposals mapped back to target ids in the graph
            if spec.draft_to_target is None:
                raise DFlashError("a reduced-vocabulary draft needs its d2t / t2d maps (DraftSpec.from_dir reads them)")
            self.lm_head = nn.Parameter(lm_head_weight.new_zeros(spec.draft_vocab, width), requires_grad=False)
            self.register_buffer("draft_to_target", torch.from_numpy(spec.draft_to_target), persistent=False)
            self.register_buffer("target_columns", torch.from_numpy(target_columns(spec.draft_to_target, vocab)),
                                 persistent=False)
        if spec.kind == "dflash2":
            self.candidate_selector = CandidateSelector(vocab, width, spec.selector_rank, spec.selector_top_k)
        if spec.markov_rank:
            self.markov_head = MarkovHead(vocab, width, spec.markov_rank, spec.markov_head_type, spec.draft_vocab)
        if spec.confidence_head:
            self.confidence_head = ConfidenceHead(width + (spec.markov_rank if spec.confidence_with_markov else 0))

    @property
    def num_kv_heads(self) -> int:
        return self.spec.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].self_attn.head_dim

    def load_checkpoint(self, draft_dir: Path) -> None:
        """Load a published draft's safetensors (keys without prefix), strictly."""
        files = weight_files(Path(draft_dir), "draft")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            try:
                state.update(load_file(str(file)))
            except Exception as exc:  # safetensors raises several types for corrupt files
                raise DFlashError(f"cannot read draft weights {file}: {exc}") from None
        reduced = self.spec.draft_vocab is not None
        own = {k for k in self.state_dict() if k not in ("embed_tokens", "lm_head")}
        for key in MAP_KEYS if reduced else ():  # read by DraftSpec.from_dir
            state.pop(key, None)
        if reduced:  # its own head: one row per draft token (DraftSpec.from_dir found it there)
            state["lm_head"] = state.pop(HEAD_KEY)
            own.add("lm_head")
        for shared in ("embed_tokens.weight", "lm_head.weight"):  # some drafts ship copies: the target's win
            state.pop(shared, None)
        missing = sorted(own - state.keys())
        unexpected = sorted(set(state) - own)
        if missing:
            raise DFlashError(f"draft weights in {draft_dir} lack {len(missing)} tensors, e.g. {missing[:3]}")
        if unexpected:
            raise DFlashError(
                f"draft weights in {draft_dir} have {len(unexpected)} unknown tensors, e.g. {unexpected[:3]}"
            )
        for name, tensor in self.state_dict().items():
            if name in state and tuple(state[name].shape) != tuple(tensor.shape):
                raise DFlashError(
                    f"draft tensor {name} has shape {tuple(state[name].shape)}, config implies {tuple(tensor.shape)}"
                )
        self.load_state_dict({k: v.to(self.fc.weight.dtype) for k, v in state.items()}, strict=False)

    def empty_cache(self, batch: int = 1, dtype=torch.float32) -> list[torch.Tensor]:
        shape = (batch, 0, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=dtype) for _ in range(2 * len(self.layers))]

    def hidden(self, input_ids, target_hidden, position_ids, past_kv: list[torch.Tensor]):
        """Final-normed hidden states of the whole block, and the present context K/V per layer."""
        hidden = F.embedding(input_ids, self.embed_tokens) * self.spec.input_embedding_scale
        context = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(hidden, position_ids)
        present: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            hidden, key, value = layer(hidden, context, cos, sin, past_kv[2 * i], past_kv[2 * i + 1])
            present += [key, value]
        return self.norm(hidden), present

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.lm_head) * self.spec.output_multiplier
        cap = self.spec.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def signal_outputs(self) -> list[str]:
        """Graph outputs after `draft_confidence`, in every form (greedy ones too): what else the verify policy can
        read per proposal. A draft with a confidence head also returns the argmax probability of its biased
        logits, so that a head predicting acceptance worse than that probability cannot cost speed."""
        return [ARGMAX_PROBABILITY] if hasattr(self, "confidence_head") else []

    def extra_outputs(self) -> list[str]:
        """Graph outputs besides logits, ids, confidences and K/V: DFlash2's candidates and their scores after each
        possible previous candidate, which sampling walks (dflash_onnx/runtime/sampling.py)."""
        return ["candidates", "candidate_scores"] if self.spec.kind == "dflash2" else []

    def extra_inputs(self) -> list[str]:
        """Graph inputs after the K/V: a DSpark draft with a Markov head draws its chain inside the call (each
        position's bias follows the token drawn before it, which only a draw inside the call can know), from a
        uniform per proposal [b, P] at a temperature [b] (0: the greedy chain)."""
        return SAMPLED_INPUTS if self.spec.kind == "dspark" and hasattr(self, "markov_head") else []

    def _markov_chain(self, logits: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor, skipped: int,
                      sampling: tuple[torch.Tensor, torch.Tensor] | None = None):
        """DSpark's chain: each proposal's logits plus the Markov bias of the token before it (the anchor, then
        the previous proposal), and the confidence head's prediction for it. `skipped`: leading slots that
        propose nothing but still advance an rnn head's state (their previous token is the anchor).
        `sampling` (uniforms [b, P], temperatures [b]): where a row's temperature is above 0, each proposal is
        drawn by inverse CDF of softmax(logits / temperature) at its uniform instead of taken by argmax, so the
        draft's distribution is exactly that along the drawn chain (no top-k / top-p: rejection sampling is
        exact with any draft distribution). A reduced-vocabulary draft draws among its own tokens and hands on
        each as its target id (the Markov head's lookup and the proposals), its logits spread over the target's
        vocabulary (-inf off its tokens)."""
        head, previous, state = getattr(self, "markov_head", None), anchor[:, None], None
        biased, ids, confident = [], [], []
        reduced = self.spec.draft_vocab is not None  # rows over the draft's tokens; ids and the result's logits not
        if sampling is not None:
            uniform, temperature = sampling
            sampled = (temperature > 0)[:, None]
            scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None, None]
        for slot in range(hidden.shape[1]):  # each slot kept as a [batch, 1, ...] slice: MatMul, never Gemm
            code, here = None, hidden[:, slot : slot + 1]
            row = logits[:, slot : slot + 1]
            if head is not None:
                bias, code, state = head.step(previous, here, state)
                row = row + bias.to(row.dtype)
            if slot >= skipped:
                if hasattr(self, "confidence_head"):
                    features = here if code is None or not self.spec.confidence_with_markov else \
                        torch.cat([here, code.to(hidden.dtype)], dim=-1)
                    confident.append(self.confidence_head(features))
                previous = torch.argmax(row, dim=-1)
                if sampling is not None:
                    cdf = torch.cumsum(torch.softmax(row.float() / scale, dim=-1), dim=-1)
                    point = uniform[:, slot - skipped, None, None] * cdf[..., -1:]
                    drawn = torch.clamp((cdf <= point).sum(dim=-1), max=row.shape[-1] - 1)
                    previous = torch.where(sampled, drawn, previous)
                if reduced:  # the draft's token as its target id: the next bias looks it up by that id
                    previous = self.draft_to_target.index_select(0, previous.reshape(-1)).reshape(previous.shape)
                biased.append(row)
                ids.append(previous)
        logits = torch.cat(biased, 1)
        signals = [torch.cat(confident, 1), confidence(logits)] if confident else [confidence(logits)]
        return spread(logits, self.target_columns) if reduced else logits, torch.cat(ids, 1), *signals

    def propose(self, hidden: torch.Tensor, anchor: torch.Tensor,
                sampling: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """From the block's final hidden states [b, B, H] and its anchor ids [b]: logits, the greedy proposals
        and their confidence for the proposing slots (1.., or from the anchor's with sample_from_anchor), then
        signal_outputs() and extra_outputs(). DFlash proposes each slot's argmax; DFlash2 the selector's chain
        over each slot's top-k; DSpark the argmax of its Markov-biased logits, chained (or, given `sampling`,
        draws: see _markov_chain), its confidence the head's predicted acceptance."""
        first = 0 if self.spec.sample_from_anchor else 1
        if self.spec.kind == "dspark":
            body = hidden if self.spec.markov_head_type == "rnn" else hidden[:, first:]
            skipped = first if self.spec.markov_head_type == "rnn" else 0
            return self._markov_chain(self.logits(body), body, anchor, skipped, sampling)
        logits = self.logits(hidden[:, first:])
        if self.spec.draft_vocab is not None:  # a dflash draft (draft_formats.py): proposals as target ids
            best = torch.argmax(logits, dim=-1)
            ids = self.draft_to_target.index_select(0, best.reshape(-1)).reshape(best.shape)  # Gather, not GatherND
            return spread(logits, self.target_columns), ids, confidence(logits)
        if self.spec.kind == "dflash2":
            candidates, scores, ids, chosen = self.candidate_selector.lattice(logits, hidden[:, first:], anchor)
            rows = torch.cat([torch.zeros_like(chosen[:, :1]), chosen[:, :-1]], dim=1)  # each slot's previous pick
            top_k = self.spec.selector_top_k  # a Python int: an int read from a traced shape does not convert
            picked = scores.gather(2, rows[:, :, None, None].expand(-1, -1, 1, top_k))[:, :, 0]
            sure = torch.softmax(picked, dim=-1).gather(2, chosen[:, :, None])[..., 0]
            return logits, ids, sure, candidates, scores
        return logits, torch.argmax(logits, dim=-1), confidence(logits)

    def forward(self, input_ids, target_hidden, position_ids, *rest):
        """Graph signature: (input_ids, target_hidden, position_ids, *past K/V, *extra_inputs()) ->
        propose()'s outputs, then the present context K/V."""
        count = 2 * len(self.layers)
        hidden, present = self.hidden(input_ids, target_hidden, position_ids, list(rest[:count]))
        sampling = tuple(rest[count:]) or None
        return (*self.propose(hidden, input_ids[:, 0], sampling), *present)
