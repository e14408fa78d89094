"""Manifests built in memory, for tests of parts that read a manifest but no graph file (the decoding loop
over scripted sessions, passes run on hand-made graphs)."""

from __future__ import annotations

from dflash_onnx.runtime.manifest import CostModel, GraphSpec, Lowering, Manifest, TensorSpec


def _graph(file: str, layers: int, kv_heads: int, head_dim: int, inputs: dict, outputs: dict) -> GraphSpec:
    kv_in = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    kv_out = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    kv_shape = ["batch", "past", kv_heads, head_dim]
    return GraphSpec(file=file, inputs=[TensorSpec(n, d, s) for n, (d, s) in inputs.items()]
                     + [TensorSpec(n, "float32", kv_shape) for n in kv_in],
                     outputs=[TensorSpec(n, d, s) for n, (d, s) in outputs.items()]
                     + [TensorSpec(n, "float32", kv_shape) for n in kv_out],
                     num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, kv_inputs=kv_in, kv_outputs=kv_out)


def make_manifest(block_size: int = 4, vocab_size: int = 32, hidden: int = 8, taps: int = 2, layers: int = 1,
                  kv_heads: int = 1, head_dim: int = 4, stop_token_ids: tuple[int, ...] = (), mask_token_id: int = 31,
                  form: str = "concat", ctx_len: int | None = None, prefill_len: int | None = None,
                  lowering: Lowering | None = None, confidence: bool = False,
                  costs: CostModel | None = None, proposals: int | None = None) -> Manifest:
    """A concat-form export's manifest (or, with `form` and `lowering`, a lowered one's) with these sizes."""
    target = _graph("target.onnx", layers, kv_heads, head_dim,
                    {"input_ids": ("int64", ["batch", "seq"]), "position_ids": ("int64", ["batch", "seq"])},
                    {"logits": ("float32", ["batch", "seq", vocab_size]), "greedy_ids": ("int64", ["batch", "seq"]),
                     "target_hidden": ("float32", ["batch", "seq", taps * hidden])})
    proposing = block_size - 1 if proposals is None else proposals
    draft = _graph("draft.onnx", layers, kv_heads, head_dim,
                   {"input_ids": ("int64", ["batch", block_size]),
                    "target_hidden": ("float32", ["batch", "ctx_new", taps * hidden]),
                    "position_ids": ("int64", ["batch", "ctx_new + block"])},
                   {"logits": ("float32", ["batch", proposing, vocab_size]),
                    "draft_ids": ("int64", ["batch", proposing]),
                    **({"draft_confidence": ("float32", ["batch", proposing])} if confidence else {})})
    return Manifest(block_size=block_size, trained_block_size=block_size, target_layer_ids=list(range(taps)),
                    mask_token_id=mask_token_id, stop_token_ids=list(stop_token_ids), vocab_size=vocab_size,
                    target_hidden_size=hidden, draft_hidden_size=hidden, dtype="float32", opset=18, target=target,
                    draft=draft, model_type="qwen3", tokenizer=False, sources={}, tool_version="test", form=form,
                    ctx_len=ctx_len, prefill_len=prefill_len, lowering=lowering, costs=costs,
                    draft_proposals=proposals)
