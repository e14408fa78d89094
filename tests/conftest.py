"""Shared tiny pairs: built and exported once per test session (exports cost ~20 s each)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflash_onnx.decode import Decoder
from dflash_onnx.export import export_pair
from dflash_onnx.tiny import TinySpec, build_pair

# Each exported pair covers a different corner: GQA ratios 1/2/4, 1-3 draft layers, tapped layers
# including the last but one, block sizes 2/4/8/16, causal and non-causal, sliding windows in the draft and
# in a hybrid target, Llama.
EXPORTED = {
    "agree_b8": TinySpec(agree=True, tie_embeddings=False, block_size=8, draft_layers=1, target_layer_ids=[1, 2]),
    "causal_gqa4_b4": TinySpec(num_heads=8, num_kv_heads=2, head_dim=8, draft_layers=2, block_size=4,
                               is_causal=True, target_layer_ids=[0, 2], target_sliding_window=5, seed=3),
    "llama_sliding_b16": TinySpec(model_type="llama", num_heads=4, num_kv_heads=4, draft_layers=3, block_size=16,
                                  sliding_window=6, agree=True, tie_embeddings=False, target_layer_ids=[0, 1, 2],
                                  seed=5),
    "agree_b2": TinySpec(agree=True, tie_embeddings=False, block_size=2, target_layer_ids=[2], seed=7),
    "agree_b4_fp16": TinySpec(agree=True, tie_embeddings=False, block_size=4, target_layer_ids=[1, 2], seed=11),
}
DTYPES = {"agree_b4_fp16": "float16"}


@dataclass
class ExportedPair:
    spec: TinySpec
    target_dir: Path
    draft_dir: Path
    out: Path
    export_seconds: float

    def decoder(self) -> Decoder:
        return Decoder.open(self.out)


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """exported(name) -> ExportedPair, built on first use and shared by every test."""
    cache: dict[str, ExportedPair] = {}

    def get(name: str) -> ExportedPair:
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            target_dir, draft_dir = build_pair(EXPORTED[name], root)
            start = time.perf_counter()
            export_pair(target_dir, draft_dir, root / "out", dtype=DTYPES.get(name, "float32"), progress=False)
            cache[name] = ExportedPair(EXPORTED[name], target_dir, draft_dir, root / "out",
                                       time.perf_counter() - start)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def decoders(exported):
    cache: dict[str, Decoder] = {}

    def get(name: str) -> Decoder:
        if name not in cache:
            cache[name] = exported(name).decoder()
        return cache[name]

    return get
