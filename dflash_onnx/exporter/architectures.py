"""Which target architectures this exporter builds, and the one line for those it does not.

The exported target is one graph shape: every layer full or sliding-window softmax attention over grouped K/V of
the head sizes the config gives each layer (Gemma 4's layers also share K/V and add per-layer embeddings, inside
transformers' own forward), a dense MLP or (the families in ROUTED_FAMILIES) a mixture of experts routed by softmax
top-k, and logits as they are or softcapped. A model with parts outside that is refused before anything is loaded,
traced or written, naming its architecture and each missing part; what transformers or the
ONNX exporter raise for an architecture no rule here foresaw becomes one line too, never a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dflash_onnx.runtime.errors import DFlashError

EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
# families whose every MoE block exports as one dflash::MoE node (dflash_onnx/exporter/models/experts.py)
ROUTED_FAMILIES = ("qwen3_moe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_next")
# families whose experts export as one dflash::SwigluMoE node per layer: gpt-oss's biased, clamped SwiGLU experts
# (dflash_onnx/exporter/models/swiglu_experts.py)
SWIGLU_FAMILIES = ("gpt_oss",)
# families whose experts modules, given their router's choice, export as one dflash::GeluTanhExperts node per layer
# (dflash_onnx/exporter/models/gelu_experts.py): Gemma 4's MoE layers
GELU_EXPERTS_FAMILIES = ("gemma4_text",)
# families whose linear-attention layers export with their state as graph I/O (dflash_onnx/exporter/models/hybrid.py)
HYBRID_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# what a layer may set for itself: its K/V's shape (Gemma 4's full-attention layers; models/target.py kv_layer_shapes)
PER_LAYER_SHAPES = ("head_dim", "num_key_value_heads")
SUPPORTED = ("dense decoders export (Qwen3, LLaMA, Qwen2, Mistral, Phi-3, OLMo 2, GLM-4, Gemma 3, Granite; "
             "sliding-window layers included), Gemma 4 (dense and MoE), Qwen3-MoE, Qwen2-MoE, gpt-oss, and the "
             "Gated-DeltaNet hybrids Qwen3.5 / Qwen3.5-MoE / Qwen3-Next")


def _attribute(config, name: str):
    """A config attribute, or None where it is absent or only defined per layer (transformers raises then)."""
    try:
        return getattr(config, name, None)
    except Exception:  # AmbiguousGlobalPerLayerAttributeError: a per-layer attribute read as a global one
        return None


def missing_parts(config) -> list[str]:
    """The parts of a transformers text config (`get_text_config(decoder=True)`) the exported graphs lack."""
    parts = []
    experts = next((_attribute(config, k) for k in EXPERT_COUNTS if _attribute(config, k)), None)
    if (experts or _attribute(config, "enable_moe_block")) and \
            config.model_type not in ROUTED_FAMILIES + SWIGLU_FAMILIES + GELU_EXPERTS_FAMILIES:
        parts.append(f"mixture-of-experts layers{f' ({experts} experts)' if experts else ''}")
    if "linear_attention" in (_attribute(config, "layer_types") or []) and config.model_type not in HYBRID_FAMILIES:
        parts.append("Gated-DeltaNet linear-attention layers (conv and recurrent state beside the K/V)")
    if _attribute(config, "kv_lora_rank"):
        parts.append(f"multi-head latent attention (K/V compressed to rank {_attribute(config, 'kv_lora_rank')})")
    overrides = sorted({key for layer in (config.to_dict().get("per_layer_config") or {}).values() for key in layer}
                       - set(PER_LAYER_SHAPES))
    if overrides:
        parts.append(f"per-layer {', '.join(overrides)} (layers of different shapes)")
    return parts


def check_architecture(config, where: str) -> None:
    """Refuse a target config (the whole one: a multimodal config is judged by its text model) that is not a
    causal LM transformers builds, or whose text model has parts the exported graphs lack."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise DFlashError(f"target {where} is a {config.model_type} model, which transformers does not build as a "
                          f"causal LM (AutoModelForCausalLM): not supported; {SUPPORTED}")
    parts = missing_parts(config.get_text_config(decoder=True))
    if parts:
        raise DFlashError(f"target {where} is a {config.model_type} model with {'; '.join(parts)}: the exporter "
                          f"does not build {'these' if len(parts) > 1 else 'this'} yet; {SUPPORTED}")


@contextmanager
def refused_unless_built(model_type: str, step: str) -> Iterator[None]:
    """What transformers or torch.onnx raise while `step` runs on an architecture no rule above foresaw, as one
    line naming it (the machine's own errors, out of memory or disk, pass through to their own messages)."""
    try:
        yield
    except (DFlashError, OSError, MemoryError):
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise DFlashError(f"target {model_type}: {step} failed ({type(exc).__name__}: {first}): this architecture "
                          f"is not supported yet; {SUPPORTED}") from exc
