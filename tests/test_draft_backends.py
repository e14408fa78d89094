"""DFlash2 and DSpark drafts (in the speculators format) exported and lowered to every backend: ONNX Runtime, MLX,
AI 100's retained form (run by ONNX Runtime, the state fed back by the host) and CoreML (its packages evaluated in
numpy), each decoding HF greedy `generate`'s tokens. Apart from test_draft_family.py so that the two long files
run side by side on the suite's workers."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from transformers import AutoModelForCausalLM

from dflash_onnx.exporter.tiny import TinySpec, build_pair
from dflash_onnx.runtime.manifest import load_manifest

TAPS = [0, 1, 2]


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_exported_and_ort_lowered_drafts_decode_the_targets_greedy_tokens(kind, tmp_path, capsys):
    """A speculators-format DFlash2 / DSpark draft exported (its selector or Markov chain inside the draft graph)
    and lowered to ONNX Runtime: DFlash's tokens are the target's greedy tokens, HF's own greedy generate the
    oracle, on MLX, AI 100's retained form and CoreML too; DSpark verifies block_size + 1 tokens a step (its anchor slot
    proposes too)."""
    from dflash_onnx.cli import main
    from dflash_onnx.exporter.export import export_pair
    from dflash_onnx.exporter.models.target import hf_greedy
    from dflash_onnx.runtime.sampling import SamplingParams
    from dflash_onnx.targets import LowerRequest, open_decoder
    from dflash_onnx.targets.ort.lower import lower_ort
    from dflash_onnx.targets.ort.options import OrtOptions

    spec = TinySpec(draft_kind=kind, draft_format="speculators", target_layer_ids=TAPS, block_size=8, agree=True,
                    tie_embeddings=False, draft_layers=2, sliding_window=3)  # a window counted from the anchor
    target_dir, draft_dir = build_pair(spec, tmp_path)
    manifest = export_pair(target_dir, draft_dir, tmp_path / "out", progress=False)
    assert manifest.draft_kind == kind
    assert manifest.verify_rows == (spec.block_size + 1 if kind == "dspark" else spec.block_size)
    options = OrtOptions(ctx_len=128, spinning="calls")  # the spinning modes' timing is not what this checks
    lower_ort(tmp_path / "out", tmp_path / "ort", options, LowerRequest(progress=False))
    # the selector's TopK, Einsum, GatherElements and Pad, the Markov chain and the confidence head run on MLX, in
    # AI 100's retained form (run here by ONNX Runtime, the state fed back by the host; streamed from the
    # checkpoints, with logits for sampling: the DSpark draft then draws its chain in the graph) and in the CoreML
    # packages (evaluated here in numpy from their spec, in float16)
    assert main(["lower", str(tmp_path / "out"), "--target", "mlx", "--out", str(tmp_path / "mlx")]) == 0
    assert main(["lower", str(tmp_path / "out"), "--target", "ai100", "--out", str(tmp_path / "ai100"), "--dry-run",
                 "--ctx-len", "96", "--prefill-len", "16", "--logits"]) == 0
    report = json.loads((tmp_path / "ai100" / "dflash.json").read_text())["lowering"]["report"]["fp16_emulation"]
    assert report["decode"]["dflash_identical"] == report["decode"]["prompts"]
    rows = spec.block_size + 1 if kind == "dspark" else spec.block_size
    specializations = json.loads((tmp_path / "ai100" / "target_specializations.json").read_text())["specializations"]
    assert str(rows) in {s["symbols"]["seq_len"] for s in specializations}  # a verify's rows: DSpark's anchor too
    nodes = onnx.load(str(tmp_path / "ai100" / "draft.onnx"), load_external_data=False).graph.node
    sums = [n for n in nodes if n.op_type == "CumSum"]  # the draw's running sums, and the softmax each sums
    draw = [n.output[0] for n in sums] + [n.output[0] for n in nodes if any(n.output[0] == s.input[0] for s in sums)]
    kept = (tmp_path / "ai100" / "draft_npi.yaml").read_text()
    assert (kind == "dspark") == bool(draw) and all(f"  - {name}\n" in kept for name in draw)  # drawn in float32
    assert main(["lower", str(tmp_path / "out"), "--target", "coreml", "--out", str(tmp_path / "coreml"),
                 "--ctx-len", "96", "--prefill-len", "16"]) == 0
    assert load_manifest(tmp_path / "coreml").lowering.functions["target"]["rows"]["verify"] == rows
    if kind == "dspark":
        _coreml_chain_draws_from_the_logits_it_returns(tmp_path / "coreml")
    directories = ["out", "ort", "mlx", "ai100", "coreml"]
    target = AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()
    committed = []
    for directory in directories:
        decoder = _numpy_coreml_decoder(tmp_path / directory) if directory == "coreml" else \
            open_decoder(tmp_path / directory)
        if kind == "dspark":
            _argmax_probability_beside_the_head(decoder)
        for prompt in ([11, 22, 33, 44], [5, 9, 3]):
            want = hf_greedy(target, prompt, 20, None)
            assert decoder.generate(prompt, 20, "greedy", stop_token_ids=[]).tokens == want
            result = decoder.generate(prompt, 20, "dflash", stop_token_ids=[], verify="full")
            assert result.tokens == want
            committed += result.acceptance_lengths
            if kind == "dspark" and decoder.costs is not None:  # auto reads both of the draft's confidences
                assert decoder.generate(prompt, 20, "dflash", stop_token_ids=[], verify="auto").tokens == want
                assert len(decoder.learnt.calibrations[False]) == 2
        if kind == "dspark":  # sampled: the chain drawn in the graph (sample_uniform in), its draws accepted
            cold = SamplingParams(temperature=0.02, seed=3)
            result = decoder.generate([11, 22, 33, 44], 20, "dflash", sampling=cold, stop_token_ids=[], verify="full")
            assert len(result.tokens) == 20 and max(result.acceptance_lengths) > 1
    assert max(committed) > 1  # proposals were accepted, not only rejected
    if kind == "dspark":  # the export against our PyTorch model, the sampled chain's logits included
        capsys.readouterr()
        assert main(["parity", str(tmp_path / "out"), "--target", str(target_dir), "--draft", str(draft_dir),
                     "--prompts", "1", "--max-new-tokens", "8", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["ok"] and "draft logits (later call) (its chain drawn)" in {c["name"] for c in report["checks"]}


def _coreml_chain_draws_from_the_logits_it_returns(directory: Path) -> None:
    """CoreML computes in float16, except a DSpark chain's draw and every row after a draw (float32): each drawn
    token is the inverse-CDF draw at its uniform from the very logits row the package returns for it, recomputed
    here in float64 (a draw within float32 rounding of a boundary skipped), so rejection sampling stays exact."""
    import numpy as np
    from coremltools.proto import MIL_pb2

    from dflash_onnx.runtime.runners import open_runners
    from dflash_onnx.targets.coreml.mil_eval import read_spec

    decoder = _numpy_coreml_decoder(directory)
    manifest = decoder.manifest
    function = read_spec(directory / manifest.draft.file).mlProgram.functions["draft"]
    draw = [op for op in function.block_specializations[function.opset].operations
            if op.type in ("softmax", "cumsum")]
    assert draw and {MIL_pb2.DataType.Name(op.outputs[0].type.tensorType.dataType) for op in draw} == {"FLOAT32"}
    target, draft = open_runners(manifest, decoder.target, decoder.draft, int(manifest.prefill_len))
    rng = np.random.default_rng(7)
    checked = 0
    for step in range(6):
        out = target.forward(rng.integers(2, manifest.vocab_size - 1, size=5 + step))
        block = np.full(manifest.block_size, manifest.mask_token_id)
        uniforms, temperature = rng.random(manifest.verify_rows - 1), 50.0  # flat: many boundaries to place
        proposal = draft.propose(block, out.context, True, sample=(uniforms, temperature))
        assert proposal.logits.dtype == np.float32
        for row, uniform, drawn in zip(proposal.logits.astype(np.float64), uniforms, proposal.ids):
            cdf = np.cumsum(np.exp(row / temperature - (row / temperature).max()))
            point = uniform * cdf[-1]
            if np.min(np.abs(cdf - point)) > 1e-5 * cdf[-1]:
                assert drawn == int(np.sum(cdf <= point))
                checked += 1
    assert checked >= 24


def _argmax_probability_beside_the_head(decoder) -> None:
    """Every form of a DSpark draft with a confidence head returns, beside the head's prediction, the argmax
    probability of the biased logits it returns (the verify policy's second signal), and the policy is handed
    both."""
    import numpy as np

    from dflash_onnx.runtime.runners import ARGMAX_PROBABILITY, open_runners

    manifest = decoder.manifest
    assert ARGMAX_PROBABILITY in manifest.draft.output_names()

    def first_proposal(want_logits: bool):
        target, draft = open_runners(manifest, decoder.target, decoder.draft, int(manifest.prefill_len or 16))
        out = target.forward(np.array([11, 22, 33, 44, 5]))
        block = np.full(manifest.block_size, manifest.mask_token_id)
        block[0] = out.greedy_ids[-1]
        return draft.propose(block, out.context, want_logits)

    proposal = first_proposal(True)
    logits = proposal.logits.astype(np.float64)
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    expected = expected.max(-1) / expected.sum(-1)
    tolerance = 1e-5 if manifest.dtype == "float32" else 5e-3
    np.testing.assert_allclose(proposal.argmax_probability, expected, atol=tolerance)
    assert not np.allclose(proposal.confidence, proposal.argmax_probability, atol=1e-3)  # the head's own output
    assert proposal.signals().shape == (2, manifest.verify_rows - 1)
    greedy = first_proposal(False)  # the greedy call, without logits, returns it too
    np.testing.assert_allclose(greedy.argmax_probability, proposal.argmax_probability, atol=tolerance)


def _numpy_coreml_decoder(directory: Path):
    """A CoreML lowering's decoder with its packages evaluated in numpy (CoreML itself needs macOS)."""
    from dflash_onnx.runtime.decode import Decoder
    from dflash_onnx.targets.coreml.check import MilSession
    from dflash_onnx.targets.coreml.session import part_packages

    manifest = load_manifest(directory)
    functions = manifest.lowering.functions
    return Decoder(manifest, *(MilSession(part_packages(directory, functions[graph], getattr(manifest, graph).file),
                                          functions[graph]) for graph in ("target", "draft")))
