"""Sample inputs for single graph calls at a given context: what `steps`, `bench`'s cost curve and the
lowering checks feed a target or draft session outside the decoding loop (numpy only)."""

from __future__ import annotations

import numpy as np

from dflash_onnx.runtime.manifest import GraphSpec, Manifest
from dflash_onnx.runtime.recurrent import empty_inputs


def _kv(manifest: Manifest, graph: GraphSpec, context: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)  # random, not zeros: calloc'd zero pages would time page faults
    return {n: rng.standard_normal((1, context, *graph.kv_shape(n))).astype(manifest.numpy_dtype)
            for n in graph.kv_inputs}


def _recurrent(manifest: Manifest) -> dict[str, np.ndarray]:
    """A hybrid target's linear-attention state (random, as K/V; the size does not grow with the context) and no
    pending rows; nothing for an attention-only target."""
    spec = manifest.target.recurrent
    if spec is None:
        return {}
    rng = np.random.default_rng(2)
    return {name: (rng.standard_normal(value.shape) * 0.1).astype(value.dtype) if value.size else value
            for name, value in empty_inputs(spec, manifest.numpy_dtype).items()}


def target_feeds(manifest: Manifest, context: int, count: int) -> dict[str, np.ndarray]:
    """A target call on `count` new tokens after `context` tokens of K/V (concat form: the K/V are inputs;
    buffer form: the session holds them, the call passes the lengths)."""
    feeds = {"input_ids": np.full((1, count), 3, np.int64),
             "position_ids": np.arange(context, context + count, dtype=np.int64)[None],
             **_recurrent(manifest)}
    if manifest.form == "buffer":
        total = context + count
        return {**feeds, "seqlens_k": np.array([total - 1], np.int32),
                "total_sequence_length": np.array(total, np.int32)}
    return {**feeds, **_kv(manifest, manifest.target, context)}


SAMPLED_INPUTS = ("sample_uniform", "sample_temperature")  # dflash_onnx/exporter/models/draft.py SAMPLED_INPUTS
# a ragged lowering's draft: per batch row, how many of a call's past and new context rows are that request's own
# (passes/draft_attention.py makes its key mask from them; targets/ort/draft_batch.py feeds them)
KEY_MASK_INPUTS = ("draft_past_rows", "draft_context_rows")


def sampling_feeds(graph: GraphSpec, uniform: np.ndarray | None = None, temperature: float = 0.0
                   ) -> dict[str, np.ndarray]:
    """A DSpark draft's chain inputs, where its graph takes them (nothing otherwise): a uniform in [0, 1) per
    proposal and the temperature to draw at; temperature 0 (the default) is its greedy chain."""
    spec = next((t for t in graph.inputs if t.name == SAMPLED_INPUTS[0]), None)
    if spec is None:
        return {}
    # in float32 a uniform within 2**-25 of 1 rounds to 1.0, past every entry of the draft's running sum
    below_one = np.nextafter(np.float32(1), np.float32(0))
    draws = np.zeros(int(spec.shape[1]), np.float32) if uniform is None else \
        np.minimum(uniform.astype(np.float32), below_one)
    return {SAMPLED_INPUTS[0]: draws[None], SAMPLED_INPUTS[1]: np.array([temperature], np.float32)}


def draft_feeds(manifest: Manifest, context: int) -> dict[str, np.ndarray]:
    """A draft step with block_size new context rows after `context` cached ones (K/V inputs, except for a
    rows-form draft whose session holds them)."""
    block, features = manifest.block_size, manifest.num_taps * manifest.target_hidden_size
    rows = np.random.default_rng(1).standard_normal((1, block, features)).astype(manifest.numpy_dtype)
    return {"input_ids": np.full((1, block), manifest.mask_token_id, np.int64), "target_hidden": rows,
            "position_ids": np.arange(context, context + 2 * block, dtype=np.int64)[None],
            **({} if manifest.draft_returns_rows else _kv(manifest, manifest.draft, context)),
            **sampling_feeds(manifest.draft)}
