"""Graph passes: ONNX -> ONNX transformations of exported graphs, each a function plus a report.

Every pass has one signature, `run(model: ir.Model, context: PassContext) -> (ir.Model, details)`, on an
onnx-ir model whose weights may be memory-mapped from the source file: rewrites of the graph's structure
never read them, and passes built on protobuf tools (ORT's quantizer and float16 converter) load them and
convert inside. `details` is what the pass found and did; the pipeline writes it to passes_report.json.
`bound` is the largest logit difference against the untransformed graph the pass is allowed, relative
to the largest |logit| of the untransformed graph (tested on the tiny random pairs, whose 64-wide random
matrices are far harder to quantize than trained checkpoints).

Passes with `lowerings` are rewrites those backends' lowerings apply (they change the graph form the
runners feed, so the manifest must say so): `optimize` and `export --passes` refuse them. The ORT and MLX
lowerings share them: MLX runs the same fused buffer-form graphs (targets/mlx/ops.py has the contrib ops).
"""

from __future__ import annotations

from dflash_onnx.passes.base import GraphPass, PassContext, PassFunction, loaded_proto

__all__ = ["GraphPass", "PassContext", "PassFunction", "loaded_proto", "registry"]


def registry() -> dict[str, GraphPass]:
    from dflash_onnx.passes import (
        cleanup,
        draft_attention,
        draft_rows,
        experts,
        fp16,
        fp32,
        kv_buffer,
        ort_fusions,
        quantize,
        rope_cache,
        rope_fusion,
        sibling_matmuls,
        tidy,
    )

    LOWERINGS = ("ort", "mlx")
    passes = [
        GraphPass("cleanup", cleanup.run, 1e-5, False, "constant folding, dead code and CSE, shape inference"),
        GraphPass("rope-fusion", rope_fusion.run, 1e-5, False,
                  "one RotaryEmbedding per q/k rotation, cos/sin once per position stream "
                  "(form=com.microsoft|onnx|hoist)"),
        GraphPass("ort-fusions", ort_fusions.run, 1e-5, False,
                  "ONNX Runtime contrib fusions (onnxscript): SimplifiedLayerNormalization, "
                  "SkipSimplifiedLayerNormalization, RotaryEmbedding, MultiHeadAttention; ORT only"),
        GraphPass("int8", quantize.int8, 0.15, True, "block-wise int8 weight-only MatMulNBits",
                  recorded_defaults={"block_size": str(quantize.BLOCK_SIZE)}, written_ratio=0.75),
        GraphPass("int4", quantize.int4, 0.75, True, "block-wise int4 weight-only MatMulNBits",
                  recorded_defaults={"block_size": str(quantize.BLOCK_SIZE)}, written_ratio=0.5),
        GraphPass("fp16", fp16.run, 1e-2, True,
                  "float16 weights and activations, fp32 norm/softmax islands, draft fc pre-scaled, overflow check",
                  calibrated=True, loads_weights=True),
        GraphPass("fp32", fp32.run, 1e-5, False,
                  "bfloat16 (or float16) graphs widened to float32, exactly: for ONNX Runtime's CPU provider, "
                  "which has no bfloat16 kernels", written_ratio=2.0),
        GraphPass("draft-attention", draft_attention.run, 1e-5, False,
                  "draft: grouped-query MultiHeadAttention over per-head repeated K/V -> one ONNX Attention",
                  lowerings=LOWERINGS),
        GraphPass("rope-cache", rope_cache.run, 1e-5, False,
                  "draft: RotaryEmbedding reads a constant cos/sin cache at the call's positions (rows=N)",
                  lowerings=LOWERINGS),
        GraphPass("kv-buffer", kv_buffer.run, 1e-4, False,
                  "target: attention -> GroupQueryAttention over preallocated K/V buffers (ctx_len=N)",
                  lowerings=LOWERINGS),
        GraphPass("draft-rows", draft_rows.run, 1e-5, False,
                  "draft: K/V outputs -> the new context rows only", lowerings=LOWERINGS),
        GraphPass("moe-fusion", experts.fuse, 1e-5, False,
                  "target: mixture-of-experts nodes -> com.microsoft MoE (only the routed experts computed)",
                  lowerings=("ort",)),
        GraphPass("sibling-matmuls", sibling_matmuls.run, 1e-5, False,
                  "MatMulNBits reading the same activation (q/k/v, gate/up) -> one MatMulNBits and a Split",
                  lowerings=("ort",)),
        GraphPass("tidy", tidy.run, 1e-5, False, "dead nodes, reshape round trips, topological order"),
    ]
    return {p.name: p for p in passes}
