"""Quantized experts against oracles from outside the code that writes them. passes/experts.py packs each expert's
weights for ONNX Runtime's QMoE with ORT's own block quantizer, so neither ORT's quantizer nor the kernel reading
the packed bytes can check it; here a plain numpy dequantization of the written bytes (the layout QMoE documents: two
4-bit values a byte, low nibble first, zero point 8 or 128, a scale per block along each row's input axis) must give
back the float export's weights within the rounding a symmetric quantizer makes, and the quantized graph must keep
the float export's choices over prompts whose answers differ."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from spread import varied_prompts

from dflash_onnx.passes.pipeline import apply_pipeline
from dflash_onnx.targets import open_decoder

PAIR = "varied_moe_b4"
BLOCK = 16  # the tiny experts are 64 wide


@pytest.fixture(scope="module")
def quantized(exported, tmp_path_factory):
    cache = {}

    def get(bits: int) -> Path:
        if bits not in cache:
            cache[bits] = quantize_experts(exported(PAIR).out, tmp_path_factory.mktemp("moe") / f"int{bits}", bits)
        return cache[bits]

    return get


def quantize_experts(source: Path, out: Path, bits: int) -> Path:
    apply_pipeline(source, [f"int{bits}"], out, {"*": {"block_size": str(BLOCK)}}, progress=False)
    return out


def dequantized(packed: np.ndarray, scales: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """QMoE's [experts, rows, k * bits / 8] bytes and [experts, rows, k / block] scales as float weights, and the
    integer levels they hold (-8..7 or -128..127)."""
    if bits == 4:
        levels = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.int32) - 8
    else:
        levels = packed.astype(np.int32) - 128
    block = levels.shape[-1] // scales.shape[-1]
    return levels * np.repeat(scales.astype(np.float64), block, axis=-1), levels


def float_layout(weight: np.ndarray, name: str) -> np.ndarray:
    """The float export's expert weight as QMoE lays it out: SwiGLU's gate and up rows interleaved in fc1 (the
    export keeps transformers' gate rows, then up rows)."""
    if "gate_up" not in name:
        return weight
    half = weight.shape[1] // 2
    interleaved = np.empty_like(weight)
    interleaved[:, 0::2], interleaved[:, 1::2] = weight[:, :half], weight[:, half:]
    return interleaved


def check_expert_weights(source: Path, quantized_dir: Path, bits: int) -> dict[str, float]:
    """Every QMoE weight of the quantized target, dequantized in numpy, against the float export's: a level below
    the top is within half a step of the float weight (round to nearest), the top level (where the block's extreme
    of the other sign is clamped) within a step, and the rounding averages about a quarter step. Returns the mean
    error in steps per weight."""
    floats = {i.name: i for i in onnx.load(str(source / "target.onnx")).graph.initializer}
    graph = onnx.load(str(quantized_dir / "target.onnx"))
    written = {i.name: i for i in graph.graph.initializer}
    nodes = [n for n in graph.graph.node if n.op_type == "QMoE"]
    assert nodes and all(n.attribute[[a.name for a in n.attribute].index("expert_weight_bits")].i == bits
                         for n in nodes)
    errors = {}
    for node in nodes:
        for packed_name, scales_name in ((node.input[2], node.input[3]), (node.input[5], node.input[6])):
            base = packed_name.rsplit("_Q", 1)[0]
            scales = numpy_helper.to_array(written[scales_name])
            weights, levels = dequantized(numpy_helper.to_array(written[packed_name]), scales, bits)
            want = float_layout(numpy_helper.to_array(floats[base]).astype(np.float64), base)
            assert weights.shape == want.shape, (base, weights.shape, want.shape)
            step = np.repeat(np.abs(scales.astype(np.float64)), levels.shape[-1] // scales.shape[-1], axis=-1)
            error = np.abs(weights - want) / np.maximum(step, 1e-30)
            top = levels == (1 << (bits - 1)) - 1
            assert error[~top].max() <= 0.5 + 1e-3, (base, float(error[~top].max()))
            assert error[top].max(initial=0.0) <= 1.0 + 1e-3, (base, float(error[top].max()))
            errors[base] = float(error.mean())
            assert errors[base] < 0.3, (base, errors[base])
    return errors


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_experts_dequantize_to_the_float_weights(exported, quantized, bits):
    errors = check_expert_weights(exported(PAIR).out, quantized(bits), bits)
    assert len(errors) == 2 * exported(PAIR).spec.target_layers  # fc1 and fc2 of every MoE layer


def target_logits(decoder, prompt: list[int]) -> np.ndarray:
    """The target's logits at every prompt position, one call from an empty cache (export graphs)."""
    manifest = decoder.manifest
    empty = {n: np.zeros((1, 0, manifest.target.num_kv_heads, manifest.target.head_dim), np.float32)
             for n in manifest.target.kv_inputs}
    out = decoder.target.run({"input_ids": np.array([prompt]), "position_ids": np.arange(len(prompt))[None],
                              **empty}, ["logits"])
    return out["logits"][0]


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_moe_keeps_the_float_exports_choices(exported, decoders, quantized, bits):
    """Over prompts whose answers differ, the quantized graph never changes the float export's choice where the
    float margin is clear (a quarter of the largest logit), and agrees at most positions elsewhere (measured on this
    pair: int4 117 of 134, int8 130 of 134; near-ties of the logits or of the router flip)."""
    exact, approx = decoders(PAIR), open_decoder(quantized(bits))
    prompts = varied_prompts(exact.manifest.vocab_size, 8, seed=4, shortest=8, longest=24)
    agree = total = clear = 0
    for prompt in prompts:
        want, got = target_logits(exact, prompt), target_logits(approx, prompt)
        top2 = np.sort(want, axis=-1)[:, -2:]
        wide = (top2[:, 1] - top2[:, 0]) > 0.25 * np.abs(want).max()  # a clear choice: no quantizer may flip it
        same = got.argmax(-1) == want.argmax(-1)
        assert same[wide].all(), prompt
        agree, total, clear = agree + int(same.sum()), total + len(same), clear + int(wide.sum())
    assert clear >= total // 4, (clear, total)  # the clear choices are a real share of the positions
    assert agree / total >= (0.95 if bits == 8 else 0.8), (agree, total)
