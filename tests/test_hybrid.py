"""Gated-DeltaNet hybrid targets (Qwen3.5): linear-attention layers export with their conv and recurrent state as
graph inputs and outputs beside the full-attention layers' K/V, a partial acceptance commits exactly the accepted
prefix's state (pending rows replayed by the next call), and greedy and DFlash decode to HF greedy's tokens on the
export and on the ORT lowering, at every acceptance length. Oracles: transformers' Qwen3_5ForCausalLM, its own
forward and greedy `generate`."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
import pytest
import torch
from conftest import EXPORTED
from spread import assert_decodes, discriminating_outputs, varied_prompts

from dflash_onnx.cli import main
from dflash_onnx.exporter.models.hybrid import HybridTarget
from dflash_onnx.exporter.models.target import hf_greedy
from dflash_onnx.exporter.pair import load_target
from dflash_onnx.exporter.tiny import build_pair
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.runtime.recurrent import input_names, output_names
from dflash_onnx.targets import LowerRequest, open_decoder
from dflash_onnx.targets.ort.lower import lower_ort
from dflash_onnx.targets.ort.options import OrtOptions

# the equality tests' prompts (their outputs differ, and change when the prompt is cut: conftest's hybrid_b4)
DECODED = varied_prompts(96, 4, seed=5, shortest=4, longest=20)
NEW_TOKENS = 24
# drafted tokens the scripted draft gets right, step after step: every acceptance length of a block of 4
SCRIPT = (0, 3, 1, 2, 3, 0, 2, 1)


@pytest.fixture(scope="module")
def hybrid(exported):
    return exported("hybrid_b4")


@pytest.fixture(scope="module")
def hf_lm(hybrid):
    return load_target(hybrid.target_dir)


@pytest.fixture(scope="module")
def hybrid_ort(hybrid, tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid_ort") / "ort"
    lower_ort(hybrid.out, out, OrtOptions(ctx_len=256), LowerRequest(progress=False))
    return out


@pytest.fixture(scope="module")
def references(hf_lm) -> list[list[int]]:
    """HF greedy's tokens for DECODED, checked first to tell the prompts apart."""
    return discriminating_outputs(DECODED, lambda prompt: hf_greedy(hf_lm, prompt, NEW_TOKENS, None))


class ScriptedDraft:
    """The real draft session, its proposals replaced: the first SCRIPT[step] drafted tokens are HF greedy's
    continuation, the rest a token greedy does not pick, so each step's acceptance length is known."""

    def __init__(self, session, sequence: list[int], block_size: int, vocab: int):
        self.session, self.sequence, self.block, self.vocab, self.step = session, sequence, block_size, vocab, 0

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run(self, feeds, output_names=None):
        out = dict(self.session.run(feeds, output_names))
        start = int(feeds["position_ids"][0, -self.block])  # the block's first position: the committed length
        right = SCRIPT[self.step % len(SCRIPT)]
        self.step += 1
        proposals = []
        for offset in range(1, self.block):
            truth = self.sequence[start + offset] if start + offset < len(self.sequence) else 0
            proposals.append(truth if offset <= right else (truth + 1) % self.vocab)
        out["draft_ids"] = np.array([proposals], dtype=out["draft_ids"].dtype)
        return out


def _layer_types(hybrid) -> list[str]:
    return json.loads((hybrid.target_dir / "config.json").read_text())["layer_types"]


def test_the_wrapper_is_the_model_and_a_partial_commit_keeps_only_the_accepted_prefix(hf_lm):
    """HybridTarget against Qwen3_5ForCausalLM's own forward, in one call and in calls that commit all rows, then
    only 3 of 8 (the rest rejected): the next call continues from exactly the accepted prefix."""
    tapped = HybridTarget(hf_lm, [1, 2]).eval()
    ids = torch.tensor([[40, 2, 66, 17, 9, 31, 8, 70, 12, 4, 51, 3, 88, 14, 60, 23, 5, 77, 19, 42]])
    with torch.no_grad():
        theirs = hf_lm(input_ids=ids).logits
        whole = tapped(ids, torch.arange(20)[None], *tapped.empty_cache())
        first = tapped(ids[:, :12], torch.arange(12)[None], *tapped.empty_cache())
        second = tapped(ids[:, 12:], torch.arange(12, 20)[None], *tapped.next_state(first[3:], 12, 12))
        rejected = tapped(torch.tensor([[9, 9, 9, 9, 9]]), torch.arange(15, 20)[None],
                          *tapped.next_state(second[3:], 8, 3))  # 3 of 8 accepted, then other tokens
        resumed = tapped(ids[:, 15:], torch.arange(15, 20)[None], *tapped.next_state(second[3:], 8, 3))
    assert float((whole[0] - theirs).abs().max()) < 2e-5
    assert float((second[0] - theirs[:, 12:]).abs().max()) < 2e-5
    assert float((resumed[0] - theirs[:, 15:]).abs().max()) < 2e-5
    assert float((rejected[0] - theirs[:, 15:]).abs().max()) > 1e-2  # the check can fail: other tokens differ


def test_the_export_carries_the_linear_attention_state_beside_the_attention_layers_kv(hybrid):
    manifest = load_manifest(hybrid.out)
    types = _layer_types(hybrid)
    linear = [i for i, kind in enumerate(types) if kind == "linear_attention"]
    attention = [i for i, kind in enumerate(types) if kind == "full_attention"]
    spec = manifest.target.recurrent
    assert spec is not None and spec.layers == linear and attention
    assert (spec.conv_rows, spec.heads, spec.key_dim, spec.value_dim) == (3, 4, 8, 8)
    assert manifest.target.kv_inputs == [f"past_key_values.{i}.{k}" for i in attention for k in ("key", "value")]
    graph = onnx.load(str(hybrid.out / "target.onnx"), load_external_data=False)
    inputs = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.graph.input}
    outputs = {v.name for v in graph.graph.output}
    for layer in linear:
        assert set(input_names(layer)) <= set(inputs) and set(output_names(layer)) <= outputs
        assert isinstance(inputs[f"pending.{layer}.delta"][1], str)  # pending rows: a dynamic axis
        assert inputs[f"past_state.{layer}.recurrent"][1:] == [4, 8, 8]
    # each linear layer: one Scan replays the pending rows, one runs the call's tokens
    assert sum(node.op_type == "Scan" for node in graph.graph.node) == 2 * len(linear)


def test_parity_against_transformers_and_why_the_reference_package_is_not_compared(hybrid, capsys):
    code = main(["parity", str(hybrid.out), "--prompts", "2", "--max-new-tokens", "16", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"], [c for c in report["checks"] if not c["ok"]]
    assert any(c["name"] == "present K/V and state (verify)" for c in report["checks"])
    assert "recurrent state" in report["reference_skipped"] and not report["reference_available"]


def test_the_reference_package_leaves_greedy_on_a_hybrid_target(hybrid, hf_lm, references):
    """Why parity skips it (the reason it prints): the reference rolls back with DynamicCache.crop, which leaves
    rejected tokens in the recurrent state. Should transformers fix that, this fails and parity can compare it."""
    from dflash.model import dflash_generate

    from dflash_onnx.exporter.pair import load_reference_draft

    reference = load_reference_draft(hybrid.draft_dir)
    diverged = 0
    for prompt, ours in zip(DECODED, references):
        with torch.no_grad():
            out = dflash_generate(reference, hf_lm, torch.tensor(prompt)[None], NEW_TOKENS, None, block_size=4)
        diverged += out[0, len(prompt):].tolist() != ours
    assert diverged


@pytest.mark.parametrize("form", ["export", "ort"])
def test_greedy_and_dflash_give_hf_greedy_tokens_at_every_acceptance_length(form, hybrid, hybrid_ort, references):
    decoder = open_decoder(hybrid.out if form == "export" else hybrid_ort)
    manifest = decoder.manifest
    assert_decodes(decoder, DECODED, references, NEW_TOKENS)  # the draft's own proposals, right in part
    for prompt, expected in zip(DECODED, references):
        scripted = ScriptedDraft(decoder.draft, [*prompt, *expected], manifest.block_size, manifest.vocab_size)
        result = decoder.sharing(draft=scripted).generate(prompt, NEW_TOKENS, stop_token_ids=[], verify="full")
        assert result.tokens == expected
        assert {1, 2, 3, 4} <= set(result.acceptance_lengths)  # every partial commit, and a whole block


def test_a_replayed_commit_is_the_state_the_tokens_reached(hybrid):
    """The next call applies committed rows with the same operations the tokens' own step used: replaying all 4
    rows of a call gives its final state bit for bit (so greedy and DFlash states never drift apart)."""
    import onnxruntime as ort

    manifest = load_manifest(hybrid.out)
    session = ort.InferenceSession(str(hybrid.out / "target.onnx"))
    tapped_names = [i.name for i in session.get_inputs()]
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 96, (1, 4)), "position_ids": np.arange(4)[None]}
    for name in manifest.target.kv_inputs:
        feeds[name] = np.zeros((1, 0, manifest.target.num_kv_heads, manifest.target.head_dim), np.float32)
    spec = manifest.target.recurrent
    for layer in spec.layers:
        conv, recurrent, decay, key, delta = input_names(layer)
        feeds[conv] = rng.standard_normal((1, spec.conv_rows, spec.conv_channels)).astype(np.float32)
        feeds[recurrent] = rng.standard_normal((1, spec.heads, spec.key_dim, spec.value_dim)).astype(np.float32)
        feeds.update({decay: np.zeros((1, 0, spec.heads), np.float32),
                      key: np.zeros((1, 0, spec.heads, spec.key_dim), np.float32),
                      delta: np.zeros((1, 0, spec.heads, spec.value_dim), np.float32)})
    first = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    replay = dict(feeds, input_ids=feeds["input_ids"][:, :1], position_ids=np.array([[4]]))
    for layer in spec.layers:
        _, recurrent, *pending = input_names(layer)
        _, base, _, *rows = output_names(layer)
        replay[recurrent] = first[base]
        replay.update(dict(zip(pending, (first[r] for r in rows))))
    assert set(replay) == set(tapped_names)
    again = dict(zip([o.name for o in session.get_outputs()], session.run(None, replay)))
    for layer in spec.layers:
        _, base, end, *_ = output_names(layer)
        assert np.array_equal(again[base], first[end])
        assert not np.array_equal(first[base], first[end])


def test_the_ort_lowering_keeps_the_state_on_the_host_and_its_rows_batch_invariant(hybrid_ort):
    manifest = load_manifest(hybrid_ort)
    assert manifest.form == "buffer" and manifest.target.recurrent is not None
    assert manifest.lowering.report["batch_invariance"]["invariant"]  # measured with the state fed and committed
    graph = onnx.load(str(hybrid_ort / "target.onnx"), load_external_data=False)
    ops = [node.op_type for node in graph.graph.node]
    assert ops.count("GroupQueryAttention") == len(manifest.target.kv_inputs) // 2  # the attention layers only
    assert ops.count("Scan") == 2 * len(manifest.target.recurrent.layers)


@pytest.mark.parametrize("backend", ["mlx", "ai100", "coreml"])
def test_the_other_lowerings_refuse_linear_attention_in_one_line(backend, hybrid, tmp_path, capsys):
    code = main(["lower", str(hybrid.out), "--target", backend, "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "Gated-DeltaNet" in err and "--target ort" in err
    assert not (tmp_path / "out").exists()


def test_the_gated_deltanet_families_pass_the_architecture_check():
    """Qwen3.5, Qwen3.5-MoE and Qwen3-Next (its q, k, v, z projected in one interleaved matrix, split by its own
    method; exported and decoded in tests/test_experts.py)."""
    from transformers import CONFIG_MAPPING

    from dflash_onnx.exporter.architectures import missing_parts

    for family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        assert missing_parts(CONFIG_MAPPING[family]().get_text_config(decoder=True)) == []


def test_a_published_multimodal_checkpoint_exports_its_text_model_streamed(tmp_path):
    """Qwen3.5 ships as Qwen3_5ForConditionalGeneration (model.language_model.*, model.visual.*): the streamed
    export reads the text weights through transformers' own renaming and decodes HF greedy's tokens."""
    from transformers import Qwen3_5ForConditionalGeneration

    from dflash_onnx.exporter.export import export_pair

    build_pair(replace(EXPORTED["hybrid_b4"], multimodal=True), tmp_path)
    composite = Qwen3_5ForConditionalGeneration.from_pretrained(str(tmp_path / "target")).eval()
    assert any(name.startswith("model.visual.") for name, _ in composite.named_parameters())
    lm = load_target(tmp_path / "target")
    ids = torch.tensor([DECODED[1]])
    with torch.no_grad():
        assert torch.equal(lm(input_ids=ids).logits, composite(input_ids=ids).logits)  # the oracle is the text model
    export_pair(tmp_path / "target", tmp_path / "draft", tmp_path / "out", progress=False)
    expected = discriminating_outputs(DECODED, lambda prompt: hf_greedy(lm, prompt, 16, None))
    assert_decodes(open_decoder(tmp_path / "out"), DECODED, expected, 16)


def test_a_float16_export_lowers_with_its_zero_centred_norms_fused(hybrid, tmp_path, references):
    """Qwen3.5's RMSNorm scales by (1 + w) in float32: fused beside float16 inputs, ORT refused to load the graph
    (the Qwen3.5-4B-shaped lowering failed so). The scale is cast to the input's type; tokens still equal."""
    from dflash_onnx.exporter.export import export_pair

    export_pair(hybrid.target_dir, hybrid.draft_dir, tmp_path / "fp16", dtype="float16", progress=False)
    lowered = lower_ort(tmp_path / "fp16", tmp_path / "ort", OrtOptions(ctx_len=256), LowerRequest(progress=False))
    assert lowered.lowering.rewrites["ort-fusions"]["target"]["fused"]["norm_scales_cast"] > 0
    decoder = open_decoder(tmp_path / "ort")
    prompt = DECODED[1]
    greedy = decoder.generate(prompt, NEW_TOKENS, mode="greedy", stop_token_ids=[]).tokens
    assert decoder.generate(prompt, NEW_TOKENS, stop_token_ids=[], verify="full").tokens == greedy
    assert greedy[:4] == references[1][:4]  # float16 follows float32's greedy at least at first


def test_the_family_benchmark_compares_the_hybrid_with_the_same_shape_all_full_attention():
    from conftest import benchmark_script
    from transformers import AutoConfig

    from dflash_onnx.exporter.tiny import _target_config

    script = benchmark_script("family_decode")
    args = script.argparse.Namespace(family="hybrid", vocab=512, hidden=256, layers=8, linear_heads=(2, 4),
                                     linear_head_dim=32, peers="")
    pair = script.specs(args)
    with_peers = script.specs(script.argparse.Namespace(**{**vars(args), "peers": "ort-genai"}))
    assert with_peers["hybrid"].multimodal and not pair["hybrid"].multimodal  # the layout onnxruntime-genai builds
    types = {name: AutoConfig.for_model(spec.model_type, **_target_config(spec)).layer_types
             for name, spec in pair.items()}
    assert types["hybrid"].count("linear_attention") == 6 and set(types["dense"]) == {"full_attention"}
    assert {k: v for k, v in vars(pair["hybrid"]).items() if k != "full_attention_interval"} == \
        {k: v for k, v in vars(pair["dense"]).items() if k != "full_attention_interval"}
