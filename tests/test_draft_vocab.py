"""A draft that proposes from a reduced vocabulary (speculators' draft_vocab_size with t2d / d2t): exported and
lowered, its graph proposes target ids, its logits span the target's vocabulary (-inf off the draft's tokens), and
DFlash decodes exactly HF greedy; for DFlash and DSpark drafts. (The drafts against speculators' own model classes:
tests/test_draft_family.py.)"""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from dflash_onnx.exporter.export import export_pair
from dflash_onnx.exporter.models.target import hf_greedy
from dflash_onnx.exporter.pair import load_target
from dflash_onnx.exporter.tiny import TinySpec, build_pair
from dflash_onnx.parity import run_parity
from dflash_onnx.runtime.differences import scaled_difference
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.runners import open_draft_runner
from dflash_onnx.runtime.sampling import SamplingParams
from dflash_onnx.targets import LowerRequest, open_decoder
from dflash_onnx.targets.ort.lower import lower_ort

SPEC = TinySpec(draft_kind="dflash", draft_format="speculators", draft_vocab_size=24, agree=True,
                tie_embeddings=False, block_size=8, target_layer_ids=[1, 2])
PROMPTS = [[3, 14, 15, 92, 65], [2, 71, 82, 81, 82, 84, 59]]


@pytest.fixture(scope="module", params=["dflash", "dspark"])
def pair(request, tmp_path_factory):
    """The pair exported and lowered for ORT: a DFlash draft, and a DSpark draft whose Markov head biases its own
    tokens and looks the previous one up by its target id (speculators' MarkovHead)."""
    root = tmp_path_factory.mktemp(f"draft_vocab_{request.param}")
    build_pair(replace(SPEC, draft_kind=request.param), root)
    export_pair(root / "target", root / "draft", root / "export", progress=False)
    lower_ort(root / "export", root / "ort", request=LowerRequest(progress=False))
    return root


def test_differences_count_equal_infinities_as_agreeing_and_one_sided_ones_as_infinite():
    want = np.array([[1.0, -np.inf, 2.0]])
    assert scaled_difference(want, np.array([[1.0, -np.inf, 2.5]])) == pytest.approx(0.25)
    assert scaled_difference(want, np.array([[1.0, 0.0, 2.0]])) == np.inf  # |a - b| alone: nan, which passes
    assert scaled_difference(want, np.array([[np.nan, -np.inf, 2.0]])) == np.inf


def test_the_graph_proposes_target_ids_from_the_drafts_tokens_only(pair):
    tokens = np.flatnonzero(load_file(str(pair / "draft" / "model.safetensors"))["t2d"].numpy())
    assert len(tokens) == SPEC.draft_vocab_size and not np.array_equal(tokens, np.arange(len(tokens)))
    decoder = open_decoder(pair / "ort")
    manifest = decoder.manifest
    block = np.full(manifest.block_size, manifest.mask_token_id)
    block[0] = 3
    features = np.random.default_rng(0).standard_normal((5, manifest.num_taps * manifest.target_hidden_size))
    proposal = open_draft_runner(manifest, decoder.draft).propose(block, features.astype(np.float32), True)
    assert proposal.logits.shape[-1] == SPEC.vocab_size
    off = np.setdiff1d(np.arange(SPEC.vocab_size), tokens)
    assert np.isneginf(proposal.logits[..., off]).all() and np.isfinite(proposal.logits[..., tokens]).all()
    assert set(proposal.ids.tolist()) <= set(tokens.tolist())
    assert proposal.ids.tolist() == tokens[proposal.logits[..., tokens].argmax(-1)].reshape(-1).tolist()


def test_dflash_decodes_hf_greedy_with_whole_blocks_accepted(pair):
    report = run_parity(pair / "export", num_prompts=2, max_new_tokens=16)
    assert report.ok, [c for c in report.checks if not c.ok]
    lm = load_target(pair / "target", "float32")
    decoder = open_decoder(pair / "ort")
    for prompt in PROMPTS:
        # every block verified: tau then measures the draft, not the verify policy (which weighs this machine's
        # measured step times, and may find a draft call too dear beside a tiny target's steps)
        result = decoder.generate(prompt, 24, "dflash", stop_token_ids=[], verify="full")
        assert result.tokens == hf_greedy(lm, prompt, 24, None)
        assert result.tau > 3.0  # the favourite is among the draft's tokens: proposals mapped back are accepted
        assert decoder.generate(prompt, 24, "dflash", stop_token_ids=[]).tokens == result.tokens  # auto too


def test_sampled_dflash_still_emits_tokens_the_draft_cannot_propose(pair):
    """Rejection sampling over the spread logits: the draft gives its missing tokens probability 0, and a rejected
    step's residual draw (max(p - q, 0)) still reaches them, so sampling keeps the target's whole vocabulary."""
    tokens = set(np.flatnonzero(load_file(str(pair / "draft" / "model.safetensors"))["t2d"].numpy()).tolist())
    decoder = open_decoder(pair / "ort")
    result = decoder.generate(PROMPTS[1], 64, "dflash", SamplingParams(temperature=3.0, seed=0), stop_token_ids=[],
                              verify="full")  # every step drafts a whole block
    assert len(result.tokens) == 64 and all(0 <= t < SPEC.vocab_size for t in result.tokens)
    assert set(result.tokens) - tokens and set(result.tokens) & tokens


def test_a_pair_loaded_whole_exports_the_same_draft(pair, tmp_path):
    export_pair(pair / "target", pair / "draft", tmp_path / "whole", progress=False, stream=False)
    streamed, whole = open_decoder(pair / "export"), open_decoder(tmp_path / "whole")
    for prompt in PROMPTS:
        assert whole.generate(prompt, 16, "dflash", stop_token_ids=[]).tokens == \
            streamed.generate(prompt, 16, "dflash", stop_token_ids=[]).tokens


@pytest.mark.parametrize("dropped,message", [("d2t", r"lack \['d2t'\]"), ("lm_head.weight", "lack lm_head.weight")])
@pytest.mark.parametrize("stream", [True, False])
def test_a_reduced_draft_missing_its_maps_or_head_is_refused_in_one_line(pair, tmp_path, dropped, message, stream):
    draft = tmp_path / "draft"
    shutil.copytree(pair / "draft", draft)
    state = load_file(str(draft / "model.safetensors"))
    del state[dropped]
    save_file(state, str(draft / "model.safetensors"))
    with pytest.raises(DFlashError, match=message):
        export_pair(pair / "target", draft, tmp_path / "out", progress=False, stream=stream)
    assert not (tmp_path / "out").exists()


def test_the_mlx_lowering_runs_it_too(pair, tmp_path):
    pytest.importorskip("mlx.core", reason="MLX is not installed: pip install 'mlx[cpu]' (Linux) or mlx (macOS)")
    from dflash_onnx.targets.mlx.lower import lower_mlx
    from dflash_onnx.targets.mlx.options import MlxOptions

    lower_mlx(pair / "export", tmp_path / "mlx", MlxOptions(ctx_len=512), LowerRequest(progress=False))
    lm = load_target(pair / "target", "float32")
    decoder = open_decoder(tmp_path / "mlx")
    # every block verified: tau then measures the draft, not MLX's cost curve (whose verify may not pay on this CPU)
    result = decoder.generate(PROMPTS[0], 24, "dflash", stop_token_ids=[], verify="full")
    assert result.tokens == hf_greedy(lm, PROMPTS[0], 24, None) and result.tau > 3.0
