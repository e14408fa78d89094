"""float16 export: fp16 graphs, lossless against their own greedy output, close to PyTorch fp16."""

from __future__ import annotations

import numpy as np

from dflash_onnx.parity import run_parity
from dflash_onnx.runtime.manifest import load_manifest


def test_fp16_graphs_take_fp16_kv(exported):
    manifest = load_manifest(exported("agree_b4_fp16").out)
    assert manifest.dtype == "float16"
    dtypes = {t.name: t.dtype for t in manifest.target.inputs + manifest.draft.inputs}
    assert dtypes["past_key_values.0.key"] == "float16" and dtypes["target_hidden"] == "float16"


def test_fp16_draft_keeps_float32_rope_frequencies(exported):
    import torch

    from dflash_onnx.exporter.pair import load_draft, load_target

    pair = exported("agree_b4_fp16")
    draft = load_draft(pair.draft_dir, load_target(pair.target_dir, "float16"), "float16")
    assert draft.fc.weight.dtype == torch.float16 and draft.rotary_emb.inv_freq.dtype == torch.float32


def test_fp16_dflash_equals_fp16_greedy(decoders):
    decoder = decoders("agree_b4_fp16")
    rng = np.random.default_rng(3)
    lengths = []
    for _ in range(6):
        prompt = rng.integers(2, 95, size=5)
        dflash = decoder.generate(prompt, 24, "dflash", stop_token_ids=[])
        assert dflash.tokens == decoder.generate(prompt, 24, "greedy", stop_token_ids=[]).tokens
        lengths += dflash.acceptance_lengths
    assert max(lengths) > 1


def test_fp16_parity_with_pytorch(exported, decoders):
    pair = exported("agree_b4_fp16")
    report = run_parity(pair.out, pair.target_dir, pair.draft_dir, num_prompts=2, max_new_tokens=12,
                        decoder=decoders("agree_b4_fp16"))
    assert report.ok, report.table()


def test_lowering_a_float16_export_for_cpu_warns_about_memory(exported, tmp_path, capsys):
    """ORT's CPU provider widens float16 weights to float32 per session: the lowering says so and names int4."""
    from dflash_onnx.cli import main

    assert main(["lower", str(exported("agree_b4_fp16").out), "--target", "ort", "--out", str(tmp_path / "ort"),
                 "--ctx-len", "128", "--spinning", "off", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "no float16 MatMul" in err and "--passes int4" in err
