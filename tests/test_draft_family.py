"""DFlash2 and DSpark drafts (and DFlash in the speculators format) against their oracles on the same random
weights: speculators' own model classes (its training forward for one anchor, its selector and Markov/confidence
heads for the greedy chains) and, for z-lab's DFlash2 layout, the reference `dflash` package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from speculators_reference import MODELS, SpeculatorModelConfig  # skips the module when the oracle is missing
from transformers import AutoModelForCausalLM

from dflash_onnx.exporter.models.draft import DraftSpec
from dflash_onnx.exporter.models.draft_formats import DFLASH2_KEYS, speculators_config
from dflash_onnx.exporter.pair import load_draft
from dflash_onnx.exporter.tiny import TinySpec, build_pair
from dflash_onnx.runtime.errors import DFlashError

TAPS = [0, 1, 2]
CASES = {
    "dflash": TinySpec(draft_kind="dflash", draft_format="speculators"),
    "dflash_sliding_causal": TinySpec(draft_kind="dflash", draft_format="speculators", draft_layers=2,
                                      sliding_window=3),
    "dflash_draft_vocab": TinySpec(draft_kind="dflash", draft_format="speculators", draft_vocab_size=40),
    "dflash2_k2_g16_top4": TinySpec(draft_kind="dflash2", draft_format="speculators"),
    "dflash2_k3_g8_top8_sliding": TinySpec(draft_kind="dflash2", draft_format="speculators", draft_layers=2,
                                           sliding_window=3, conv_kernel_size=3, conv_group_size=8,
                                           selector_top_k=8, selector_rank=4),
    "dflash2_k1_g64_b8": TinySpec(draft_kind="dflash2", draft_format="speculators", conv_kernel_size=1,
                                  conv_group_size=64, block_size=8),
    "dspark_vanilla": TinySpec(draft_kind="dspark", draft_format="speculators"),
    "dspark_gated_sliding": TinySpec(draft_kind="dspark", draft_format="speculators", markov_head_type="gated",
                                     draft_layers=2, sliding_window=3),
    "dspark_rnn_not_from_anchor": TinySpec(draft_kind="dspark", draft_format="speculators",
                                           markov_head_type="rnn", sample_from_anchor=False),
    "dspark_confidence_alone": TinySpec(draft_kind="dspark", draft_format="speculators",
                                        confidence_with_markov=False, markov_rank=4),
    "dspark_draft_vocab": TinySpec(draft_kind="dspark", draft_format="speculators", markov_head_type="gated",
                                   draft_vocab_size=40),
}


def _pair(name: str, tmp_path: Path):
    spec = TinySpec(**{**CASES[name].__dict__, "target_layer_ids": TAPS})
    target_dir, draft_dir = build_pair(spec, tmp_path)
    return spec, AutoModelForCausalLM.from_pretrained(str(target_dir)).eval(), draft_dir


def _oracle(draft_dir: Path, target):
    """speculators' model class from the draft's config.json, with its weights and the target's embedding and
    head."""
    raw = json.loads((draft_dir / "config.json").read_text())
    config = SpeculatorModelConfig.from_dict(raw)
    config.transformer_layer_config._attn_implementation = "eager"
    model = MODELS[raw["speculators_model_type"]](config)
    head = target.get_output_embeddings().weight
    state = load_file(str(draft_dir / "model.safetensors"))
    if "t2d" in state:  # a reduced vocabulary: its own head is in the checkpoint, the verifier's is the target's rows
        state["verifier_lm_head.weight"] = head[state["t2d"]]
    else:
        state.update({"lm_head.weight": head, "verifier_lm_head.weight": head})
    state.update({"embed_tokens.weight": target.get_input_embeddings().weight,
                  "verifier_norm.weight": torch.ones(head.shape[1])})
    model.load_state_dict(state, strict=True)
    return model.eval()


def _oracle_block(model, features, ids, anchor):
    """The oracle's hidden states and logits of the block anchored at `anchor`, by its own training forward."""
    length = features.shape[1]
    loss_mask = torch.zeros(1, length, dtype=torch.long)
    loss_mask[0, anchor] = 1
    last_hidden = torch.zeros(1, length, features.shape[2] // len(TAPS))  # the training targets' input: unused here
    hidden, logits, *_ = model._backbone_forward(features, ids, loss_mask, last_hidden,
                                                 torch.zeros(1, length, dtype=torch.long), None, max_anchors=1)
    return hidden, logits


def _oracle_chain(model, kind, hidden, logits, anchor_id, first):
    """The oracle's greedy proposals (and, for DSpark, their biased logits and confidences) from one block."""
    anchor = torch.tensor([anchor_id])
    reduced = getattr(model, "use_draft_vocab", False)
    targets = torch.arange(logits.shape[-1]) + model.d2t if reduced else None  # speculators' d2t: offsets

    def spread(rows):  # a reduced draft's rows over the target's vocabulary, -inf off its tokens
        if not reduced:
            return rows
        wide = torch.full((*rows.shape[:-1], model.t2d.shape[0]), float("-inf"))
        wide[..., targets] = rows
        return wide

    if kind == "dflash":
        rows = logits[:, first:]
        best = rows[0].argmax(-1)
        return spread(rows), targets[best] if reduced else best, None
    if kind == "dflash2":
        previous, ids = anchor, []
        for slot in range(first, logits.shape[1]):
            candidates, scores = model.candidate_selector.select(logits[:, slot], hidden[:, slot], previous)
            previous = candidates.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
            ids.append(int(previous))
        return logits[:, first:], torch.tensor(ids), None
    head, config = model.markov_head, model.config
    previous = [anchor_id] * (1 if config.sample_from_anchor else 2)  # slot 0 (and slot 1) follow the anchor
    biased, ids, sure = [], [], []
    for slot in range(first, logits.shape[1]):
        prev = torch.tensor([previous[: slot + 1]])
        row = logits[:, slot]
        code = None
        if head is not None:
            row = row + head.block_bias(prev_token_ids=prev, hidden_states=hidden[:, : slot + 1])[:, -1]
            code = head.prev_embeddings(prev[:, -1])
        if model.confidence_head is not None:
            features = torch.cat([hidden[:, slot], code], -1) if config.confidence_head_with_markov else hidden[:, slot]
            sure.append(torch.sigmoid(model.confidence_head(features)))
        best = int(row.argmax(-1))
        ids.append(int(targets[best]) if reduced else best)  # the Markov head looks tokens up by target id
        previous.append(ids[-1])
        biased.append(row)
    return spread(torch.stack(biased, 1)), torch.tensor(ids), torch.cat(sure) if sure else None


@pytest.mark.parametrize("name", sorted(CASES))
def test_draft_matches_speculators_on_a_first_and_a_cached_call(name, tmp_path):
    spec, target, draft_dir = _pair(name, tmp_path)
    ours, oracle = load_draft(draft_dir, target), _oracle(draft_dir, target)
    kind, block = spec.draft_kind, spec.block_size
    first = 0 if ours.spec.sample_from_anchor else 1
    assert ours.spec.proposals(block) == block - first
    torch.manual_seed(3)
    length = 20
    features = torch.randn(1, length, len(TAPS) * spec.hidden_size)
    ids = torch.randint(0, spec.vocab_size - 1, (1, length))
    past, seen = ours.empty_cache(), 0
    for anchor in (6, 11):  # a first call reads a prompt's features; the later one a step's, over its cache
        block_ids = torch.full((1, block), spec.vocab_size - 1)
        block_ids[0, 0] = ids[0, anchor]
        with torch.no_grad():
            positions = torch.arange(seen, anchor + block)[None]
            logits, got, sure, *rest = ours(block_ids, features[:, seen:anchor], positions, *past)
            signals = [rest.pop(0) for _ in ours.signal_outputs()]  # a confidence head's: the argmax probability
            past = rest[2:] if kind == "dflash2" else rest
            hidden, unary = _oracle_block(oracle, features, ids, anchor)
            want_logits, want, want_sure = _oracle_chain(oracle, kind, hidden, unary, int(ids[0, anchor]), first)
        seen = anchor
        torch.testing.assert_close(logits, want_logits, atol=5e-5, rtol=1e-4)
        assert got[0].tolist() == want.tolist()
        if want_sure is not None:
            torch.testing.assert_close(sure[0], want_sure, atol=1e-6, rtol=1e-5)
            # (a reduced vocabulary's logits are -inf off its tokens: they add nothing to the softmax)
            torch.testing.assert_close(signals[0], torch.softmax(want_logits.float(), -1).amax(-1), atol=1e-6,
                                       rtol=1e-5)
        assert past[0].shape[1] == anchor


@pytest.mark.parametrize("name", ["dspark_vanilla", "dspark_gated_sliding", "dspark_rnn_not_from_anchor",
                                  "dspark_draft_vocab"])
def test_dspark_draws_its_chain_with_each_bias_after_the_token_drawn_before(name, tmp_path):
    """Sampling a DSpark draft: each position's logits carry the Markov bias of the token drawn before it (the
    oracle: speculators' head over the drawn chain), and each draw is the inverse CDF of softmax(logits / T) at
    the call's uniform; at temperature 0 the call is the greedy chain. A reduced-vocabulary draft draws among its
    own tokens (target ids, each biasing the next by that id), its logits -inf elsewhere."""
    import numpy as np

    spec, target, draft_dir = _pair(name, tmp_path)
    ours, oracle = load_draft(draft_dir, target), _oracle(draft_dir, target)
    first = 0 if ours.spec.sample_from_anchor else 1
    proposals, temperature = ours.spec.proposals(spec.block_size), 1.5
    torch.manual_seed(5)
    features = torch.randn(1, 20, len(TAPS) * spec.hidden_size)
    ids = torch.randint(0, spec.vocab_size - 1, (1, 20))
    anchor = 9
    block_ids = torch.full((1, spec.block_size), spec.vocab_size - 1)
    block_ids[0, 0] = ids[0, anchor]
    uniform = torch.rand(1, proposals)
    args = (block_ids, features[:, :anchor], torch.arange(anchor + spec.block_size)[None], *ours.empty_cache())
    with torch.no_grad():
        greedy_logits, greedy, *_ = ours(*args)
        at_zero = ours(*args, uniform, torch.tensor([0.0]))  # temperature 0: the greedy chain, whatever the uniforms
        logits, drawn, *_ = ours(*args, uniform, torch.tensor([temperature]))
        hidden, unary = _oracle_block(oracle, features, ids, anchor)
        previous = [int(ids[0, anchor])] * (1 if first == 0 else 2) + drawn[0].tolist()
        # a reduced draft's own tokens (speculators' d2t: offsets to target ids); every token otherwise
        columns = torch.arange(unary.shape[-1]) + oracle.d2t if spec.draft_vocab_size else slice(None)
        for position, slot in enumerate(range(first, spec.block_size)):
            prev = torch.tensor([previous[: slot + 1]])
            want = unary[:, slot] + oracle.markov_head.block_bias(prev_token_ids=prev,
                                                                  hidden_states=hidden[:, : slot + 1])[:, -1]
            torch.testing.assert_close(logits[:, position, columns], want, atol=5e-5, rtol=1e-4)
    if spec.draft_vocab_size:
        assert set(drawn[0].tolist()) <= set(columns.tolist()) and torch.isneginf(logits).sum() > 0
    scaled = logits[0].double().numpy() / temperature
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    cdf = np.cumsum(probs / probs.sum(-1, keepdims=True), -1)
    assert drawn[0].tolist() == [int(np.searchsorted(c, u, side="right")) for c, u in zip(cdf, uniform[0].tolist())]
    assert drawn[0].tolist() != greedy[0].tolist()  # the draws left the greedy chain: their biases were their own
    assert not torch.equal(logits, greedy_logits)
    assert torch.equal(at_zero[0], greedy_logits) and torch.equal(at_zero[1], greedy)


def test_zlab_dflash2_matches_the_reference_package(tmp_path):
    """z-lab's layout (a Qwen3 config with dflash_config; the selector's codebooks stored without `.weight`, as
    published) against the reference package's own DFlash2 model and its propose()."""
    from reference import dflash_model

    spec = TinySpec(draft_kind="dflash2", target_layer_ids=TAPS, block_size=6, conv_kernel_size=3, conv_group_size=8)
    target_dir, draft_dir = build_pair(spec, tmp_path)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()
    ours = load_draft(draft_dir, target)
    reference = dflash_model.DFlash2DraftModel.from_pretrained(str(draft_dir)).eval()
    cache, past, start = dflash_model._make_cache(reference.config), ours.empty_cache(), 0
    torch.manual_seed(2)
    for context in (5, 3):
        features = torch.randn(1, context, len(TAPS) * spec.hidden_size)
        block = torch.full((1, spec.block_size), spec.vocab_size - 1)
        block[0, 0] = int(torch.randint(0, 90, ()))
        positions = torch.arange(start, start + context + spec.block_size)[None]
        with torch.no_grad():
            logits, got, _, _, _, *past = ours(block, features, positions, *past)
            embed = dflash_model._raw_input_embeddings(target, block, 1.0)
            hidden = reference(target_hidden=features, noise_embedding=embed, position_ids=positions,
                               past_key_values=cache, use_cache=True)[:, 1:]
            want, _, _ = reference.propose(hidden, block[:, 0], dflash_model._output_head(target), 0.0)
        start += context
        dflash_model._crop_to(cache, start)
        torch.testing.assert_close(logits, reference.compute_logits(hidden, dflash_model._output_head(target)),
                                   atol=5e-5, rtol=1e-4)
        assert got.tolist() == want.tolist()


def _config(**changes) -> dict:
    raw = json.loads(json.dumps(TinySpec(draft_kind="dspark", draft_format="speculators").__dict__))
    from dflash_onnx.exporter.tiny import _draft_config

    config = _draft_config(TinySpec(**raw))
    config.update(changes)
    return config


@pytest.mark.parametrize("changes,message", [
    ({"draft_vocab_size": 32, "speculators_model_type": "dflash2"}, "dflash2 draft proposes from a reduced"),
    ({"aux_hidden_state_layer_ids": [0, 2]}, "taps the target's embeddings"),
    ({"aux_hidden_state_layer_ids": None}, "needs aux_hidden_state_layer_ids"),
    ({"speculators_model_type": "eagle3"}, "not a DFlash-family draft"),
    ({"markov_head_type": "lstm"}, "markov_head_type 'lstm'"),
    ({"block_size": 1}, "block_size must be an integer >= 2"),
    ({"markov_rank": 0}, "confidence_head_with_markov needs markov_rank > 0"),
])
def test_speculators_configs_we_cannot_run_get_one_line(changes, message):
    with pytest.raises(DFlashError, match=message):
        DraftSpec.from_dict(_config(**changes))


def test_speculators_taps_count_hidden_states_from_the_embeddings():
    spec = DraftSpec.from_dict(_config(aux_hidden_state_layer_ids=[1, 3]))
    assert spec.target_layer_ids == [0, 2] and spec.num_target_layers is None
    assert spec.kind == "dspark" and spec.sample_from_anchor and spec.proposals(8) == 8


def test_a_drafts_auto_map_is_data_its_code_never_runs(tmp_path):
    """Published speculators drafts carry `auto_map` and the config class beside it: the config is read as JSON
    and the shipped file is never imported (it would leave a mark)."""
    spec, target, draft_dir = _pair("dspark_vanilla", tmp_path)
    mark = tmp_path / "ran"
    (draft_dir / "config.py").write_text(f"open({str(mark)!r}, 'w').write('ran')\n")
    assert "auto_map" in json.loads((draft_dir / "config.json").read_text())
    load_draft(draft_dir, target)
    assert not mark.exists()


def test_the_reference_peer_runs_zlab_layouts_only(tmp_path):
    """parity and `bench --peers reference` load the reference package's class for z-lab's DFlash2 layout, and
    have no reference for a speculators-format draft (the package cannot read it)."""
    from reference import dflash_model

    from dflash_onnx.exporter.pair import load_reference_draft

    _, zlab = build_pair(TinySpec(draft_kind="dflash2", target_layer_ids=TAPS), tmp_path / "zlab")
    assert isinstance(load_reference_draft(zlab), dflash_model.DFlash2DraftModel)
    _, speculators = build_pair(TinySpec(draft_kind="dflash2", draft_format="speculators", target_layer_ids=TAPS),
                                tmp_path / "speculators")
    assert load_reference_draft(speculators) is None


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_distilled_dflash2_and_dspark_drafts_learn_and_load_in_speculators(kind, tmp_path, monkeypatch):
    """`distill --draft-type dflash2|dspark`: a short run raises held-out tau, the draft is written in its
    published layout (z-lab's for DFlash2, speculators' for DSpark) and speculators' own class loads it strictly
    and proposes the same chain from a block as ours."""
    from dflash_onnx.cli import main

    target_dir, _ = build_pair(TinySpec(seed=21, block_size=8), tmp_path)
    prompts = ["".join(chr(32 + (i * 7 + j * 3) % 90) for j in range(12)) for i in range(48)]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts))
    monkeypatch.setenv("DFLASH_ONNX_CACHE", str(tmp_path / "cache"))
    out = tmp_path / kind
    assert main(["distill", "--target", str(target_dir), "--out", str(out), "--prompts", str(tmp_path / "prompts.txt"),
                 "--draft-type", kind, "--block-size", "8", "--steps", "120", "--new-tokens", "40", "--lr", "2e-3",
                 "--target-layers-tapped", "0,1,2", "--selector-rank", "8", "--selector-top-k", "4",
                 "--markov-rank", "8", "--quiet"]) == 0
    report = json.loads((out / "distill.json").read_text())
    assert report["draft_type"] == kind and report["tau_after"] > report["tau_before"] + 0.25, report
    raw = json.loads((out / "config.json").read_text())
    assert (raw.get("speculators_model_type") == "dspark") if kind == "dspark" else \
        raw["dflash_config"]["selector_top_k"] == 4
    target = AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()
    ours = load_draft(out, target)
    assert ours.spec.kind == kind
    if kind == "dflash2":  # speculators reads DFlash2 in its own format: the same weights under its config
        heads = {key: raw["dflash_config"][key] for key in DFLASH2_KEYS}
        converted = speculators_config(raw, "dflash2", heads, sample_from_anchor=False, sliding_window_non_causal=False)
        (out / "config.json").write_text(json.dumps(converted))
        again = load_draft(out, target).spec  # the two layouts describe the same draft
        fields = ("kind", "target_layer_ids", "block_size", "mask_token_id", "conv_kernel_size", "selector_top_k")
        assert [getattr(again, f) for f in fields] == [getattr(ours.spec, f) for f in fields]
    oracle = _oracle(out, target)
    first = 0 if ours.spec.sample_from_anchor else 1
    torch.manual_seed(5)
    features = torch.randn(1, 24, len(TAPS) * 64)
    ids = torch.randint(0, 95, (1, 24))
    block_ids = torch.full((1, 8), 95)
    block_ids[0, 0] = ids[0, 10]
    with torch.no_grad():
        logits, got, *_ = ours(block_ids, features[:, :10], torch.arange(18)[None], *ours.empty_cache())
        hidden, unary = _oracle_block(oracle, features, ids, 10)
        want_logits, want, _ = _oracle_chain(oracle, kind, hidden, unary, int(ids[0, 10]), first)
    torch.testing.assert_close(logits, want_logits, atol=5e-5, rtol=1e-4)
    assert got[0].tolist() == want.tolist()
