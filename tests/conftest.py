"""Shared tiny pairs: built and exported once per test session (exports cost ~20 s each)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import onnxruntime
import pytest

from dflash_onnx.exporter.export import export_pair
from dflash_onnx.exporter.tiny import TinySpec, build_pair
from dflash_onnx.runtime.decode import Decoder
from dflash_onnx.targets import LowerRequest, open_decoder

# Each exported pair covers a different corner: GQA ratios 1/2/4, 1-3 draft layers, tapped layers
# including the last but one, block sizes 2/4/8/16, causal and non-causal, sliding windows in the draft and
# in a hybrid target, Llama, mixture of experts, Gated-DeltaNet linear attention.
EXPORTED = {
    "agree_b8": TinySpec(agree=True, tie_embeddings=False, block_size=8, draft_layers=1, target_layer_ids=[1, 2]),
    "causal_gqa4_b4": TinySpec(num_heads=8, num_kv_heads=2, head_dim=8, draft_layers=2, block_size=4,
                               is_causal=True, target_layer_ids=[0, 2], target_sliding_window=5, seed=3),
    "llama_sliding_b16": TinySpec(model_type="llama", num_heads=4, num_kv_heads=4, draft_layers=3, block_size=16,
                                  sliding_window=6, agree=True, tie_embeddings=False, target_layer_ids=[0, 1, 2],
                                  seed=5),
    "agree_b2": TinySpec(agree=True, tie_embeddings=False, block_size=2, target_layer_ids=[2], seed=7),
    "agree_b4_fp16": TinySpec(agree=True, tie_embeddings=False, block_size=4, target_layer_ids=[1, 2], seed=11),
    # a Gated-DeltaNet hybrid (Qwen3.5: linear- and full-attention layers alternating), leaning towards the favourite
    # as far as the context does (over 20 prompts and 40 new tokens: 20 distinct outputs, the favourite 54% of the
    # tokens, none unchanged when the prompt is cut, tau 1.45; its lean is steep: 0.13 gives tau 1.08, 0.18 83% of
    # the tokens; seed 17's draft never proposed the favourite its target emitted)
    "hybrid_b4": TinySpec(model_type="qwen3_5_text", full_attention_interval=2, agree=True, favourite_logit=0.16,
                          tie_embeddings=False, block_size=4, target_layer_ids=[1, 2], seed=18),
    # Pairs whose greedy output depends on the whole prompt and whose draft is accepted for some positions, not all:
    # target and draft lean towards the favourite token only as far as the context does (favourite_logit), so the
    # favourite is one token among many in the output and a proposal of it is right where the target agrees.
    # tests/spread.py measures both; the end-to-end equality tests run on these.
    "varied_b4": TinySpec(agree=True, favourite_logit=0.15, tie_embeddings=False, block_size=4, sliding_window=6,
                          target_layer_ids=[1, 2], seed=19),
    "varied_window_b8": TinySpec(agree=True, favourite_logit=0.4, tie_embeddings=False, block_size=8,
                                 target_sliding_window=5, target_layer_ids=[1, 2], seed=23),
    # a mixture-of-experts target (Qwen3-MoE: 8 experts, 2 per token), its checkpoint stored one tensor per expert
    "varied_moe_b4": TinySpec(model_type="qwen3_moe", num_experts=8, experts_per_token=2, agree=True,
                              favourite_logit=1.0, tie_embeddings=False, block_size=4, target_layer_ids=[1, 2],
                              seed=29),
    # Gemma 4's MoE layers (26B-A4B's kind): routed experts beside each layer's dense MLP, experts of 32 in a hidden
    # size of 64 (their gate and up rows fit in it, as in 26B-A4B, for int4's two-QMoE form), its routers' scales
    # random (PREPARED). Leaning towards the favourite as far as the context does: over 20 prompts and 40 new
    # tokens, 20 distinct outputs, the favourite 42% of the tokens, none unchanged when the prompt is cut, tau 1.58
    # (unbiased and tied, as tests/test_gemma4.py had it: tau 1.01, the draft never right)
    "gemma4_moe_b4": TinySpec(model_type="gemma4_text", num_heads=4, num_kv_heads=2, head_dim=16, global_head_dim=32,
                              global_kv_heads=1, k_eq_v=True, num_experts=8, experts_per_token=2,
                              moe_intermediate_size=32, target_sliding_window=5, final_logit_softcapping=30.0,
                              input_embedding_scale=8.0, target_layer_ids=[1, 2], seed=29, agree=True,
                              favourite_logit=1.0, tie_embeddings=False),
}
DTYPES = {"agree_b4_fp16": "float16"}


def random_router_scales(target_dir: Path) -> None:
    """Gemma 4's routers' per-expert scales and input scale, built as ones, set to random values so that they
    count (a scale the export dropped or misplaced would change nothing otherwise)."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(target_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith(("router.per_expert_scale", "router.scale"))]:
        weights[name] = 0.5 + torch.rand(weights[name].shape, generator=generator)
    save_file(weights, str(target_dir / "model.safetensors"), metadata={"format": "pt"})


# what is done to a pair's checkpoint between building and exporting it
PREPARED = {"gemma4_moe_b4": random_router_scales}
# `lower --target ort` of each pair: causal_gqa4_b4 (sliding-window layers) keeps the concat form covered; its
# buffer form, the windows as GroupQueryAttention's local_window_size, has a test of its own. agree_b4_fp16 covers
# float16 graphs: RoPE stays out of GroupQueryAttention and the draft's rotations keep their per-call cos/sin (both
# rewrites are float32-only), the rest of the lowering applies.
KV_BUFFER = {"agree_b8": True, "llama_sliding_b16": True, "causal_gqa4_b4": False, "agree_b4_fp16": True,
             "varied_b4": True, "varied_window_b8": False}
# the pairs whose greedy output depends on the whole prompt (tests/spread.py): end-to-end equality runs on these
VARIED = ("varied_b4", "varied_window_b8", "varied_moe_b4", "hybrid_b4")


def benchmark_script(name: str):
    """A script of benchmarks/ (not a package) imported by path, for tests of its functions."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass looks its module up there while the class is made
    spec.loader.exec_module(module)
    return module


@dataclass
class ExportedPair:
    spec: TinySpec
    target_dir: Path
    draft_dir: Path
    out: Path
    export_seconds: float

    def decoder(self) -> Decoder:
        return open_decoder(self.out)


def shared_root(tmp_path_factory) -> Path:
    """A directory every xdist worker of this run sees (the run's base temp's parent under xdist), for fixtures
    built once per run rather than once per worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """exported(name) -> ExportedPair, built on first use by whichever worker asks first (a file lock keeps the
    others waiting, then they read it) and shared by every test; tests copy a pair before changing it."""
    from filelock import FileLock

    cache: dict[str, ExportedPair] = {}
    shared = shared_root(tmp_path_factory) / "exported"
    shared.mkdir(exist_ok=True)

    def get(name: str) -> ExportedPair:
        if name not in cache:
            root, done = shared / name, shared / f"{name}.seconds"
            with FileLock(str(shared / f"{name}.lock")):
                if not done.is_file():
                    target_dir, draft_dir = build_pair(EXPORTED[name], root)
                    if name in PREPARED:
                        PREPARED[name](target_dir)
                    start = time.perf_counter()
                    export_pair(target_dir, draft_dir, root / "out", dtype=DTYPES.get(name, "float32"),
                                progress=False)
                    done.write_text(f"{time.perf_counter() - start}")
            cache[name] = ExportedPair(EXPORTED[name], root / "target", root / "draft", root / "out",
                                       float(done.read_text()))
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


FAKE_COMPILER = """#!/usr/bin/env bash
# Stands in for qaic-compile: records its arguments and writes the binary dir it was given, with what the fake
# runtime (tests/fake_qaic_sdk) needs: the graph, its specializations and the cores it was compiled for.
echo "$@" >> "$FAKE_QAIC_LOG"
for arg in "$@"; do
  case "$arg" in
    -m=*) graph="${arg#-m=}";;
    -network-specialization-config=*) specs="${arg#-network-specialization-config=}";;
    -aic-num-cores=*) cores="${arg#-aic-num-cores=}";;
    -aic-binary-dir=*) out="${arg#-aic-binary-dir=}";;
  esac
done
mkdir -p "$out" && touch "$out/programqpc.bin"
printf '{"onnx": "../../%s", "specializations": "../../%s", "cores": %s}' "$graph" "$specs" "$cores" \\
  > "$out/fake_qpc.json"
"""


@pytest.fixture(scope="session")
def lowered(exported, tmp_path_factory):
    """lowered(name) -> (directory, compiler log or None): AI 100 lowerings of the exported pairs.

    agree_b8 is lowered with a fake qaic-compile on PATH (so the compile step runs); others are dry runs.
    agree_b2's graphs also return logits (sampling); the others return ids only.
    """
    from dflash_onnx.targets.ai100.lower import lower_ai100
    from dflash_onnx.targets.ai100.options import Ai100Options

    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            pair = exported(name)
            root = tmp_path_factory.mktemp(f"ai100_{name}")
            log = None
            saved_path = os.environ.get("PATH", "")
            if name == "agree_b8":
                bin_dir = root / "bin"
                bin_dir.mkdir()
                (bin_dir / "qaic-compile").write_text(FAKE_COMPILER)
                (bin_dir / "qaic-compile").chmod(0o755)
                log = root / "compiler.log"
                os.environ["PATH"] = f"{bin_dir}{os.pathsep}{saved_path}"
                os.environ["FAKE_QAIC_LOG"] = str(log)
            options = Ai100Options(ctx_len=160, prefill_len=2 * pair.spec.block_size, ccl="64,160", target_cores=12,
                                   draft_cores=4, dry_run=log is None, logits=name == "agree_b2")
            try:
                lower_ai100(pair.out, root / "ai100", options, LowerRequest(progress=False))
            finally:
                os.environ["PATH"] = saved_path
            cache[name] = (root / "ai100", log)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def ort_lowered(exported, tmp_path_factory):
    """ort_lowered(name) -> the `lower --target ort` directory of an exported pair (ctx_len 512)."""
    from dflash_onnx.targets.ort.lower import lower_ort
    from dflash_onnx.targets.ort.options import OrtOptions

    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = tmp_path_factory.mktemp("ort") / name
            lower_ort(exported(name).out, cache[name], OrtOptions(kv_buffer=KV_BUFFER[name], ctx_len=512),
                      LowerRequest(progress=False))
        return cache[name]

    return get


class CopiedWhenBound:
    """An IOBinding that does what ORT does for a host input of a graph on a device provider: the value is
    copied when it is bound, so refilling the host array afterwards changes nothing the graph reads."""

    def __init__(self, binding, kv_inputs):
        self._binding, self._kv, self._copies = binding, set(kv_inputs), {}

    def bind_ortvalue_input(self, name, value):
        if name not in self._kv:  # the K/V buffers live on the device already: bound as they are
            value = self._copies[name] = onnxruntime.OrtValue.ortvalue_from_numpy(value.numpy().copy())
        self._binding.bind_ortvalue_input(name, value)

    def __getattr__(self, name):
        return getattr(self._binding, name)
