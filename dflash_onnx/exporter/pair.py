"""Load a target directory and a DFlash draft directory and check that they belong together.

Every check runs before any expensive work and names both values when it fails.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflash_onnx.artifacts.model_dirs import read_config, weight_files
from dflash_onnx.exporter.architectures import PER_LAYER_SHAPES, check_architecture
from dflash_onnx.exporter.export_request import refuse_small_block
from dflash_onnx.exporter.models.draft import DFlashDraft, DraftSpec
from dflash_onnx.exporter.models.hybrid import wrap_target
from dflash_onnx.exporter.models.target import TappedTarget, kv_layer_shapes
from dflash_onnx.runtime.errors import DFlashError

# transformers suggests kernel packages when its models fall back to their PyTorch code: here they only check
# and trace, so the advice is noise
logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Largest logit difference accepted between two computations of the same model, per dtype.
# bfloat16 keeps 8 bits of mantissa to float16's 11: 8x float16's bound.
LOGIT_TOLERANCE = {"float32": 2e-3, "float16": 5e-2, "bfloat16": 0.4}


@dataclass
class TargetInfo:
    """What the export needs to know of the target, read from its config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    stop_token_ids: list[int]

    @classmethod
    def from_dir(cls, path: Path) -> TargetInfo:
        """Read and check the target directory: a JSON config without custom code, whole safetensors weights,
        a decoder-only LLM."""
        from transformers import AutoConfig

        path = Path(path)
        read_config(path, "target")
        weight_files(path, "target")
        from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

        try:
            config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except Exception as exc:  # transformers raises ValueError, OSError, KeyError ... for unusable configs
            raise DFlashError(f"cannot read target config in {path}: {_first_line(exc)}") from None
        if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES or config.is_encoder_decoder:
            raise DFlashError(f"target {path / 'config.json'} is a {config.model_type} model, an encoder: DFlash "
                              "targets are decoder-only causal LMs such as Qwen3, Llama, Mistral")
        check_architecture(config, str(path))
        try:
            text = config.get_text_config(decoder=True)
            kv_layer_shapes(text)  # grouped-query attention: every K/V layer's heads and head size are defined
            return cls(model_type=config.model_type, vocab_size=text.vocab_size, hidden_size=text.hidden_size,
                       num_layers=text.num_hidden_layers, stop_token_ids=_stop_token_ids(path, config))
        except AttributeError as exc:
            raise DFlashError(f"target {path / 'config.json'} ({config.model_type}) is not a decoder-only LLM with "
                              f"grouped-query attention ({exc}): DFlash targets are causal LMs such as Qwen3, Llama, "
                              "Mistral") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _stop_token_ids(path: Path, config) -> list[int]:
    """eos ids from generation_config.json (what HF generate stops on), else from config.json."""
    eos = None
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            eos = None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def validate_pair(
    target: TargetInfo, draft: DraftSpec, block_size: int | None = None, allow_longer_block: bool = False,
    dtype: str = "float32",
) -> int:
    """Raise DFlashError on the first mismatch; return the block size to use."""
    cfg = draft.config
    checks = [
        (cfg.hidden_size == target.hidden_size,
         f"draft hidden_size {cfg.hidden_size} != target hidden_size {target.hidden_size}"),
        (cfg.vocab_size == target.vocab_size,
         f"draft vocab_size {cfg.vocab_size} != target vocab_size {target.vocab_size}"),
        (draft.num_target_layers in (None, target.num_layers),  # None: the speculators format names none
         f"draft num_target_layers {draft.num_target_layers} != target num_hidden_layers {target.num_layers}"),
    ]
    for ok, message in checks:
        if not ok:
            raise DFlashError(f"target and draft do not match: {message}")
    for layer_id in draft.target_layer_ids:
        if not 0 <= layer_id < target.num_layers:
            named = (f"aux_hidden_state_layer_ids {[i + 1 for i in draft.target_layer_ids]} has {layer_id + 1}"
                     if draft.num_target_layers is None else
                     f"target_layer_ids {draft.target_layer_ids} has {layer_id}")
            raise DFlashError(f"draft {named}, outside the target's layers 0..{target.num_layers - 1}"
                              + (" (1.." + str(target.num_layers) + " counted from the embeddings)"
                                 if draft.num_target_layers is None else ""))
    if draft.mask_token_id is None:
        raise DFlashError("draft dflash_config has no mask_token_id")
    if not 0 <= draft.mask_token_id < target.vocab_size:
        raise DFlashError(
            f"draft mask_token_id {draft.mask_token_id} is outside the target vocab (size {target.vocab_size})"
        )
    if dtype not in DTYPES:
        raise DFlashError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    size = draft.block_size if block_size is None else int(block_size)
    refuse_small_block(size)  # the draft's own block size (a flag's was refused before torch loaded)
    if size > draft.block_size and not allow_longer_block:
        raise DFlashError(
            f"block size {size} is above the draft's trained block size {draft.block_size}; "
            "pass --allow-longer-block to export it anyway"
        )
    return size


def attention_implementation(config) -> str:
    """SDPA, which exports and matches HF generate; "eager" for the classes that have no SDPA path (gpt-oss, whose
    attention sinks join the softmax)."""
    from transformers import AutoModelForCausalLM

    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):  # a config no causal-LM class is registered for: the architecture check says so
        return "sdpa"
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"


def load_target(path: Path, dtype: str = "float32") -> nn.Module:
    """The HF causal LM, in eval mode, with SDPA attention where the class has it (attention_implementation)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = _target_config(Path(path))
    weight_files(path, "target")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=DTYPES[dtype], local_files_only=True, attn_implementation=attention_implementation(config),
            trust_remote_code=False, use_safetensors=True,
        )
    except Exception as exc:  # the loader raises many types; the checks above caught what a user can fix
        raise DFlashError(f"cannot load target from {path}: {_first_line(exc)}") from None
    return model.eval()


def _draft_module(spec: DraftSpec, target: nn.Module, dtype: str) -> DFlashDraft:
    draft = DFlashDraft(spec, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    inv_freq = draft.rotary_emb.inv_freq.clone()
    draft.to(DTYPES[dtype])
    draft.rotary_emb.inv_freq = inv_freq  # RoPE frequencies stay float32, as in the reference and HF
    return draft


def load_draft(path: Path, target: nn.Module, dtype: str = "float32") -> DFlashDraft:
    """The draft body from its checkpoint, with the target's embedding and lm_head."""
    draft = _draft_module(DraftSpec.from_dir(Path(path)), target, dtype)
    draft.load_checkpoint(Path(path))
    return draft.eval()


def _target_config(path: Path):
    from transformers import AutoConfig

    read_config(path, "target")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # the loader raises many types
        raise DFlashError(f"cannot read the target config in {path}: {_first_line(exc)}") from None


def _from_config(config, dtype: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype],
                                            attn_implementation=attention_implementation(config),
                                            trust_remote_code=False).eval()


def meta_pair(target_dir: Path, draft_dir: Path, target_layer_ids: list[int],
              dtype: str = "float32") -> tuple[TappedTarget, DFlashDraft]:
    """The tapped target and its draft with every parameter on the meta device: nothing read or allocated, for
    tracing a graph whose weights lazy_weights.py attaches from the checkpoints (buffers stay real)."""
    from dflash_onnx.exporter.lazy_weights import parameters_on_meta

    config = _target_config(Path(target_dir))
    with parameters_on_meta(), torch.no_grad():
        lm = _from_config(config, dtype)
        draft = _draft_module(DraftSpec.from_dir(Path(draft_dir)), lm, dtype).eval()
    return wrap_target(lm, target_layer_ids), draft


def architecture_check_model(target_dir: Path, dtype: str = "float32") -> TappedTarget:
    """A small random model of the target's architecture (its config with the fewest layers that hold every
    layer type, and a 512-token vocabulary), to check the wrapper against HF's forward before a weightless
    export: masks and head post-processing do not depend on the weights or the model's size."""
    config = _target_config(Path(target_dir))
    _keep_fewest_layers(config.get_text_config(decoder=True))
    text = config.get_text_config(decoder=True)
    text.vocab_size = min(text.vocab_size, 512)
    for token in ("bos_token_id", "eos_token_id"):
        if getattr(text, token, None) is not None:
            setattr(text, token, None)
    if (getattr(text, "pad_token_id", None) or 0) >= text.vocab_size:  # Gemma 4's forward reads the pad id
        text.pad_token_id = 0
    torch.manual_seed(0)
    with torch.no_grad():
        return wrap_target(_from_config(config, dtype), [0])


def _keep_fewest_layers(text) -> None:
    """Cut `text` to its first layer of each type (two layers at least) and, where later layers read earlier ones'
    K/V (Gemma 4's num_kv_shared_layers), the first such layer of each type, keeping each kept layer's own shape."""
    count = text.num_hidden_layers
    types = list(getattr(text, "layer_types", None) or [None] * count)
    keep = max([2] + [types.index(kind) + 1 for kind in set(types)])
    shared = int(getattr(text, "num_kv_shared_layers", 0) or 0)
    first_shared = count - shared
    kept = list(range(min(count, keep, first_shared if shared else count)))
    if shared:
        kept += [types.index(kind, first_shared) for kind in dict.fromkeys(types[first_shared:])]
    per_layer = getattr(text, "per_layer_config", None)
    shapes = {new: {key: getattr(per_layer[old], key) for key in PER_LAYER_SHAPES}
              for new, old in enumerate(kept)} if per_layer is not None else None
    text.num_hidden_layers = len(kept)
    if any(types):
        text.layer_types = [types[i] for i in kept]
    if shared:
        text.num_kv_shared_layers = sum(i >= first_shared for i in kept)
    if shapes is not None:
        text.per_layer_config = shapes


def load_tapped_pair(target_dir: Path, draft_dir: Path, target_layer_ids: list[int],
                     dtype: str = "float32") -> tuple[TappedTarget, DFlashDraft]:
    """The target wrapped to tap `target_layer_ids`, and its draft: what export and re-exporting lowerings
    convert (no gradients: conversion only)."""
    with torch.no_grad():
        lm = load_target(target_dir, dtype)
        draft = load_draft(draft_dir, lm, dtype)
    return wrap_target(lm, target_layer_ids), draft


def load_reference_draft(draft_dir: Path, dtype: str = "float32") -> nn.Module | None:
    """The reference `dflash` package's draft on the same checkpoint (an oracle: parity, bench peers), from
    safetensors only; None when the package is not installed or does not run this draft (it runs z-lab's DFlash
    and DFlash2 layouts: not the speculators format, not DSpark)."""
    try:
        from dflash.model import DFlash2DraftModel, DFlashDraftModel
    except ImportError:
        return None
    spec = DraftSpec.from_dir(Path(draft_dir))
    if spec.layout != "zlab":
        return None
    weight_files(draft_dir, "draft")
    model_class = DFlash2DraftModel if spec.kind == "dflash2" else DFlashDraftModel
    model = model_class.from_pretrained(str(draft_dir), dtype=DTYPES[dtype], local_files_only=True,
                                        use_safetensors=True, trust_remote_code=False)
    return model.eval()
