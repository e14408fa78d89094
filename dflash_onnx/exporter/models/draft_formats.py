"""The speculators format of a draft's config.json (vllm-project/speculators: `speculators_model_type` dflash,
dflash2 or dspark), read as data into DraftSpec's fields. Its `auto_map` points at a config class saved beside it:
that file is never imported or run. The verifier it names (speculators_config.verifier.name_or_path) is the
target `export --draft NAME` takes when no `--target` is given (dflash_onnx/artifacts/hub.py).

Conventions that differ from z-lab's layout, each carried into the spec:
- `aux_hidden_state_layer_ids` index transformers' `hidden_states` (0 is the embeddings), so a decoder layer i is
  i + 1 there; z-lab's `target_layer_ids` (ours) count decoder layers;
- a sliding layer's window counts back from the block's anchor, and its block queries see each other unless
  `sliding_window_non_causal` is false (full-attention layers always see the whole block);
- the embedding and output head are the target's, unscaled and without softcapping;
- DSpark's `sample_from_anchor` (its default) proposes from the anchor's slot too: block_size tokens."""

from __future__ import annotations

from transformers import Qwen3Config

from dflash_onnx.runtime.errors import DFlashError

DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
KINDS = ("dflash", "dflash2", "dspark")
MARKOV_HEADS = ("vanilla", "gated", "rnn")


def _integer(raw: dict, name: str, default: int | None = None, least: int = 1) -> int:
    value = raw.get(name, default)
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise DFlashError(f"draft config.json: {name} must be an integer >= {least}, not {value!r}")
    return value


def speculators_fields(raw: dict) -> dict:
    """DraftSpec's fields from a speculators-format config.json; one-line errors for what we cannot run."""
    kind = raw.get("speculators_model_type")
    if kind not in KINDS:
        raise DFlashError(f"draft config.json: speculators_model_type {kind!r} is not a DFlash-family draft "
                          f"(supported: {', '.join(KINDS)})")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DFlashError("draft config.json (speculators format) has no transformer_layer_config")
    if layer.get("model_type", "qwen3") != "qwen3":
        raise DFlashError(f"draft transformer_layer_config is {layer.get('model_type')!r}: only Qwen3-style draft "
                          "layers are supported")
    try:
        config = Qwen3Config(**{k: v for k, v in layer.items() if k not in ("model_type", "transformers_version")})
    except (TypeError, ValueError) as exc:
        raise DFlashError(f"draft transformer_layer_config cannot describe the draft's layers: {exc}") from None
    draft_vocab = _integer(raw, "draft_vocab_size", config.vocab_size)
    if draft_vocab > config.vocab_size:
        raise DFlashError(f"draft_vocab_size {draft_vocab} exceeds the vocabulary ({config.vocab_size})")
    if draft_vocab < config.vocab_size and kind == "dflash2":  # as speculators' DFlash2DraftModel refuses it
        raise DFlashError(f"this dflash2 draft proposes from a reduced vocabulary ({draft_vocab} of "
                          f"{config.vocab_size} tokens, d2t/t2d): DFlash2's selector codebooks index the whole "
                          "vocabulary (speculators requires it too)")
    taps = raw.get("aux_hidden_state_layer_ids")
    if not isinstance(taps, list) or not taps or not all(isinstance(t, int) for t in taps):
        raise DFlashError("draft config.json (speculators format) needs aux_hidden_state_layer_ids, the target "
                          f"layers it reads, as a list of integers (found {taps!r})")
    if min(taps) < 1:
        raise DFlashError(f"draft aux_hidden_state_layer_ids {taps} taps the target's embeddings (0): not supported")
    mask = raw.get("mask_token_id")
    fields = dict(
        config=config, target_layer_ids=[t - 1 for t in taps], block_size=_integer(raw, "block_size", 8, 2),
        mask_token_id=None if mask is None else _integer(raw, "mask_token_id", least=0), num_target_layers=None,
        input_embedding_scale=1.0, output_multiplier=1.0, final_logit_softcapping=None, kind=kind,
        sample_from_anchor=bool(raw.get("sample_from_anchor", kind == "dspark")),
        sliding_causal=not bool(raw.get("sliding_window_non_causal", kind == "dflash2")), window_from_anchor=True,
        layout="speculators", draft_vocab=draft_vocab if draft_vocab < config.vocab_size else None,
    )
    if kind == "dflash2":
        fields.update({name: _integer(raw, name) for name in DFLASH2_KEYS})
        if config.hidden_size % fields["conv_group_size"]:
            raise DFlashError(f"draft conv_group_size {fields['conv_group_size']} does not divide hidden_size "
                              f"{config.hidden_size}")
        if fields["selector_top_k"] > config.vocab_size:
            raise DFlashError(f"draft selector_top_k {fields['selector_top_k']} exceeds the vocabulary")
    if kind == "dspark":
        head = raw.get("markov_head_type", "vanilla")
        if head not in MARKOV_HEADS:
            raise DFlashError(f"draft markov_head_type {head!r}: supported {', '.join(MARKOV_HEADS)}")
        rank = _integer(raw, "markov_rank", 256, 0)
        confidence = bool(raw.get("enable_confidence_head", True))
        with_markov = confidence and bool(raw.get("confidence_head_with_markov", True))
        if with_markov and not rank:
            raise DFlashError("draft confidence_head_with_markov needs markov_rank > 0")
        fields.update(markov_rank=rank, markov_head_type=head, confidence_head=confidence,
                      confidence_with_markov=with_markov)
    return fields


def speculators_config(zlab: dict, kind: str, heads: dict, sample_from_anchor: bool,
                       sliding_window_non_causal: bool) -> dict:
    """A speculators-format config.json (as its save_pretrained writes it, minus bookkeeping) for the draft that
    z-lab's layout `zlab` describes: the inverse of speculators_fields. `heads`: what the kind adds (DFlash2's
    convolution and selector sizes, DSpark's Markov and confidence heads), under speculators' key names."""
    layer = {key: value for key, value in zlab.items()
             if key not in ("architectures", "num_target_layers", "dflash_config", "is_causal", "rope_theta")}
    layer["layer_types"] = zlab.get("layer_types") or ["full_attention"] * zlab["num_hidden_layers"]
    layer["rope_parameters"] = {"rope_theta": zlab.get("rope_theta", 10000.0), "rope_type": "default"}
    names = {"dflash": "DFlash", "dflash2": "DFlash2", "dspark": "DSpark"}
    block = zlab["dflash_config"]["block_size"]
    return {
        "architectures": [f"{names[kind]}DraftModel"], "auto_map": {"": f"config.{names[kind]}SpeculatorConfig"},
        "speculators_model_type": kind, "transformer_layer_config": layer, "draft_vocab_size": zlab["vocab_size"],
        "block_size": block, "aux_hidden_state_layer_ids": [i + 1 for i in zlab["dflash_config"]["target_layer_ids"]],
        "mask_token_id": zlab["dflash_config"]["mask_token_id"], "target_hidden_size": None,
        "tie_word_embeddings": False, "sample_from_anchor": sample_from_anchor,
        "sliding_window_non_causal": sliding_window_non_causal,
        "speculators_config": {
            "algorithm": kind, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "verifier_accept_k": 1, "accept_tolerance": 0.0,
                                  "speculative_tokens": block - 1 + sample_from_anchor}],
            "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": None}},
        **heads,
    }
