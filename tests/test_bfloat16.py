"""bfloat16 exports (issue 19): the checkpoint's bfloat16 weights stored bit for bit; ONNX Runtime's CPU provider,
which has no bfloat16 kernels, runs them widened to float32 (the fp32 pass, exact) and decodes exactly Hugging
Face greedy; MLX computes in bfloat16, checked against the widened twin; AI 100 gets float16 graphs."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from safetensors.torch import load_file, save_file

from dflash_onnx.exporter.export import export_pair
from dflash_onnx.exporter.models.target import hf_greedy
from dflash_onnx.exporter.pair import load_target
from dflash_onnx.exporter.tiny import TinySpec, build_pair
from dflash_onnx.parity import run_parity
from dflash_onnx.passes.pipeline import apply_pipeline
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets import LowerRequest, open_decoder
from dflash_onnx.targets.ort.lower import lower_ort

SPEC = TinySpec(agree=True, tie_embeddings=False, block_size=8, draft_layers=1, target_layer_ids=[1, 2], seed=13)
PROMPTS = [[5, 9, 2], [40, 41, 42, 43, 44, 45, 46]]


def _to_bfloat16(directory: Path) -> None:
    """The checkpoint as published models ship: every tensor bfloat16."""
    for file in directory.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(file)).items()}, str(file),
                  metadata={"format": "pt"})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bfloat16")
    target_dir, draft_dir = build_pair(SPEC, root)
    _to_bfloat16(target_dir)
    _to_bfloat16(draft_dir)
    export_pair(target_dir, draft_dir, root / "export", dtype="bfloat16", progress=False)
    apply_pipeline(root / "export", ["fp32"], root / "widened", progress=False)
    return root


def test_the_export_stores_the_checkpoints_bfloat16_weights_bit_for_bit(pair):
    manifest = load_manifest(pair / "export")
    assert manifest.dtype == "bfloat16" and manifest.target.kv_dtype == "bfloat16"
    assert manifest.numpy_dtype == ml_dtypes.bfloat16
    stored: set[bytes] = set()
    for graph in ("target.onnx", "draft.onnx"):
        for tensor in onnx.load(str(pair / "export" / graph)).graph.initializer:
            if tensor.data_type == onnx.TensorProto.BFLOAT16:
                value = numpy_helper.to_array(tensor).view(np.uint16)
                stored |= {value.tobytes(), value.T.tobytes()}
    checkpoint = {**load_file(str(pair / "target" / "model.safetensors")),
                  **load_file(str(pair / "draft" / "model.safetensors"))}
    matrices = {k: v for k, v in checkpoint.items() if v.ndim == 2}
    assert len(matrices) > 10
    missing = [k for k, v in matrices.items() if v.view(torch.int16).numpy().tobytes() not in stored]
    assert not missing, f"checkpoint tensors not stored bit for bit: {missing}"


def test_widened_to_float32_it_decodes_exactly_hf_greedy(pair):
    manifest = load_manifest(pair / "widened")
    assert manifest.dtype == "float32" and manifest.target.kv_dtype == "float32"
    for graph in ("target.onnx", "draft.onnx"):  # written a block of rows at a time, exactly
        narrow = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(pair / "export" / graph)).graph.initializer}
        for tensor in onnx.load(str(pair / "widened" / graph)).graph.initializer:
            assert tensor.data_type != onnx.TensorProto.BFLOAT16
            if narrow[tensor.name].dtype == ml_dtypes.bfloat16:
                np.testing.assert_array_equal(numpy_helper.to_array(tensor), narrow[tensor.name].astype(np.float32))
    report = run_parity(pair / "widened", num_prompts=2, max_new_tokens=16)  # float32 oracle, bfloat16 weights
    assert report.ok, [c for c in report.checks if not c.ok]
    decoder = open_decoder(pair / "widened")
    lm = load_target(pair / "target", "float32")
    for prompt in PROMPTS:
        result = decoder.generate(prompt, 20, "dflash", stop_token_ids=[])
        assert result.tokens == hf_greedy(lm, prompt, 20, None)
        assert result.tau > 1.0  # blocks were accepted, not only bonus tokens


def test_onnx_runtime_refuses_bfloat16_and_names_the_way_out(pair, tmp_path):
    with pytest.raises(DFlashError, match=r"no bfloat16 kernels .*no bfloat16 outputs .*--passes fp32"):
        open_decoder(pair / "export").generate(PROMPTS[0], 4, "greedy")
    with pytest.raises(DFlashError, match=r"does not run the bfloat16 export .*--passes fp32"):
        lower_ort(pair / "export", tmp_path / "ort", request=LowerRequest(progress=False))
    with pytest.raises(DFlashError, match=r"int4: .*bfloat16: widen it first, --passes fp32,int4"):
        apply_pipeline(pair / "export", ["int4"], tmp_path / "int4", progress=False)
    assert not (tmp_path / "ort").exists() and not (tmp_path / "int4").exists()


def test_widened_then_quantized_runs_on_cpu_and_dflash_keeps_its_greedy_tokens(pair, tmp_path):
    apply_pipeline(pair / "export", ["fp32", "int4"], tmp_path / "int4", {"*": {"block_size": "16"}},
                   progress=False)
    report = json.loads((tmp_path / "int4" / "passes_report.json").read_text())
    assert all(r["details"]["quantized_matmuls"] > 0 for r in report if r["pass"] == "int4")
    decoder = open_decoder(tmp_path / "int4")
    for prompt in PROMPTS:
        assert decoder.generate(prompt, 16, "dflash", stop_token_ids=[]).tokens == \
            decoder.generate(prompt, 16, "greedy", stop_token_ids=[]).tokens


def test_ai100_gets_float16_graphs_from_a_bfloat16_export(pair, tmp_path):
    from dflash_onnx.targets.ai100.lower import lower_ai100
    from dflash_onnx.targets.ai100.options import Ai100Options

    lowered = lower_ai100(pair / "export", tmp_path / "ai100", Ai100Options(dry_run=True, ctx_len=64, prefill_len=16),
                          LowerRequest(progress=False))
    assert lowered.dtype == "float16"
    graph = onnx.load(str(tmp_path / "ai100" / "target.onnx"), load_external_data=False)
    assert onnx.TensorProto.BFLOAT16 not in {t.data_type for t in graph.graph.initializer}
    assert onnx.TensorProto.FLOAT16 in {i.type.tensor_type.elem_type for i in graph.graph.input}


def test_mlx_computes_in_bfloat16_checked_against_the_widened_export(pair, tmp_path, monkeypatch):
    pytest.importorskip("mlx.core", reason="MLX is not installed: pip install 'mlx[cpu]' (Linux) or mlx (macOS)")
    from dflash_onnx.targets.mlx import lower as mlx_lower
    from dflash_onnx.targets.mlx.options import MlxOptions

    directory = tmp_path / "mlx"
    lowered = mlx_lower.lower_mlx(pair / "export", directory, MlxOptions(bits=4, group_size=32, ctx_len=256),
                                  LowerRequest(progress=False))
    assert lowered.dtype == "bfloat16"
    assert lowered.lowering.max_relative_difference <= mlx_lower.TOLERANCE["bfloat16"]
    assert not (directory / "reference").exists()  # the widened twin the check ran is gone
    decoder = open_decoder(directory)
    for prompt in PROMPTS:
        assert decoder.generate(prompt, 16, "dflash", stop_token_ids=[]).tokens == \
            decoder.generate(prompt, 16, "greedy", stop_token_ids=[]).tokens
    # the bound is tight enough to see int4 rounding (what a wrong quantization looks like to the check)
    monkeypatch.setattr(mlx_lower, "rounded_initializers", lambda directory, manifest, graph: ({}, []))
    with pytest.raises(DFlashError, match=r"the MLX lowering changes .*\(allowed 0.08\)"):
        mlx_lower._check(pair / "export", load_manifest(pair / "export"), directory, lowered, 4)
