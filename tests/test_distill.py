"""`dflash-onnx distill`: a short run on a tiny target learns, saves a draft both loaders accept, resumes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from reference import (  # skips the module when the oracle is missing
    DFlashDraftModel,
    dflash_model,
)
from transformers import AutoModelForCausalLM

from dflash_onnx.exporter.pair import load_draft, load_target
from dflash_onnx.exporter.tiny import TinySpec, build_pair
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.training import distill as distill_module
from dflash_onnx.training.distill import DistillOptions, distill

OPTIONS = {"block_size": 8, "steps": 150, "new_tokens": 40, "held_out": 8, "eval_every": 50, "lr": 2e-3}


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    target_dir, _ = build_pair(TinySpec(seed=21, block_size=8), root)
    prompts = ["".join(chr(32 + (i * 7 + j * 3) % 90) for j in range(12)) for i in range(64)]
    (root / "prompts.txt").write_text("\n".join(prompts))
    return root, target_dir


@pytest.fixture(scope="session")
def distilled(tiny_target):
    root, target_dir = tiny_target
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DFLASH_ONNX_CACHE", str(root / "cache"))
        report = distill(target_dir, root / "distilled", DistillOptions(**OPTIONS), prompts_file=root / "prompts.txt",
                         progress=False)
    return root / "distilled", report


def test_short_distillation_raises_tau_well_above_the_initial_draft(distilled):
    draft_dir, report = distilled
    assert report["steps"] == 150 and len(report["history"]) == 3
    assert report["tau_after"] > report["tau_before"] + 0.25 and report["tau_after"] > 1.3, report
    assert report["history"][-1]["loss"] < 0.8 * report["first_loss"], report  # training lowered the loss
    assert sorted(p.name for p in draft_dir.iterdir()) == ["config.json", "distill.json", "model.safetensors"]
    assert not (draft_dir.parent / "distilled.ckpt").exists()  # checkpoints are removed once the draft is written


def test_distilled_draft_loads_here_and_in_the_reference(distilled, tiny_target):
    draft_dir, _ = distilled
    _, target_dir = tiny_target
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["dflash_config"]["block_size"] == 8 and config["dflash_config"]["target_layer_ids"] == [2]
    lm = load_target(target_dir)
    draft = load_draft(draft_dir, lm)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), attn_implementation="sdpa").eval()
    reference = DFlashDraftModel.from_pretrained(str(draft_dir)).eval()
    prompt = torch.tensor([[5, 17, 29, 41, 53, 65, 77, 8, 20, 32, 44, 56]])
    out = dflash_model.dflash_generate(reference, target, prompt, 24, None, return_stats=True)
    greedy = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                             pad_token_id=0)
    assert out.output_ids[0].tolist() == greedy[0].tolist()  # lossless with the distilled draft
    assert draft.fc.weight.shape == (64, 64)


def test_resume_continues_an_interrupted_run(tiny_target, tmp_path, monkeypatch):
    root, target_dir = tiny_target
    monkeypatch.setenv("DFLASH_ONNX_CACHE", str(root / "cache"))
    options = {**OPTIONS, "steps": 40, "eval_every": 20}
    original = distill_module.objectives.draft_loss
    calls = {"n": 0}

    def interrupt_after_30_steps(*args):
        calls["n"] += 1
        if calls["n"] > 30 * 4:  # 4 sequences per step
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(distill_module.objectives, "draft_loss", interrupt_after_30_steps)
    with pytest.raises(KeyboardInterrupt):
        distill(target_dir, tmp_path / "draft", DistillOptions(**options, checkpoint_every=25),
                prompts_file=root / "prompts.txt", progress=False)
    assert (tmp_path / "draft.ckpt" / "state.safetensors").is_file() and not (tmp_path / "draft").exists()
    assert not any(p.suffix == ".pt" for p in (root / "cache").rglob("*"))  # no pickle in the training cache
    with pytest.raises(DFlashError, match="--resume"):
        distill(target_dir, tmp_path / "draft", DistillOptions(**options), prompts_file=root / "prompts.txt",
                progress=False)
    monkeypatch.setattr(distill_module.objectives, "draft_loss", original)
    with pytest.raises(DFlashError, match="saved for another draft"):  # another kind cannot resume it
        distill(target_dir, tmp_path / "draft", DistillOptions(**options, draft_type="dflash2"),
                prompts_file=root / "prompts.txt", resume=True, progress=False)
    report = distill(target_dir, tmp_path / "draft", DistillOptions(**options, checkpoint_every=25),
                     prompts_file=root / "prompts.txt", resume=True, progress=False)
    assert report["steps"] == 40 and [h["step"] for h in report["history"]] == [20, 40]


def test_distill_needs_text_and_a_fresh_out(tiny_target, tmp_path):
    _, target_dir = tiny_target
    with pytest.raises(DFlashError, match="--data FILES_OR_DIRS or --prompts FILE"):
        distill(target_dir, tmp_path / "d", DistillOptions(steps=1), progress=False)
    with pytest.raises(DFlashError, match="layers 0..3"):
        distill(target_dir, tmp_path / "d", DistillOptions(steps=1, target_layer_ids=[7]),
                prompts_file=tiny_target[0] / "prompts.txt", progress=False)
    assert np.all([not p.name.startswith(".") for p in tmp_path.iterdir()])


class _Planted:
    """Unpickling this writes a marker file: what a planted checkpoint could do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_resume_never_unpickles_a_planted_checkpoint(tiny_target, tmp_path, monkeypatch):
    import pickle

    root, target_dir = tiny_target
    monkeypatch.setenv("DFLASH_ONNX_CACHE", str(tmp_path / "cache"))
    marker = tmp_path / "code_ran"
    (tmp_path / "draft.ckpt").mkdir()
    (tmp_path / "draft.ckpt" / "state.pt").write_bytes(pickle.dumps(_Planted(marker)))  # the old format's name
    cache = tmp_path / "cache" / "distill"
    cache.mkdir(parents=True)
    (cache / "planted.pt").write_bytes(pickle.dumps(_Planted(marker)))
    report = distill(target_dir, tmp_path / "draft", DistillOptions(**{**OPTIONS, "steps": 2, "eval_every": 2}),
                     prompts_file=root / "prompts.txt", resume=True, progress=False)
    assert report["steps"] == 2 and not marker.exists()  # trained from scratch; nothing was unpickled
    pickle.loads(pickle.dumps(_Planted(tmp_path / "proof")))
    assert (tmp_path / "proof").exists()  # the payload does run when something unpickles it
