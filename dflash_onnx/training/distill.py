"""`dflash-onnx distill`: train a DFlash, DFlash2 or DSpark draft for a frozen target.

The draft shares the target's embedding and lm_head (not trained, not saved). Its layers start from the
target's last layers, fc from an average of the tapped features. Training text is the target's own greedy
continuations (dflash_onnx/training/data.py); blocks are packed per sequence (dflash_onnx/training/blocks.py). AdamW
with linear
warmup, cosine decay and gradient clipping; checkpoints in OUT.ckpt/ (safetensors + JSON,
dflash_onnx/training/checkpoint.py) let `--resume` continue; tau on held-out sequences is measured as decoding would
(acceptance of the target's greedy continuation, each kind proposing through its own chain).
`--draft-type` dflash2 adds DFlash2's convolutions (starting as the identity) and candidate selector; dspark adds
DSpark's Markov head and confidence head (dflash_onnx/training/objectives.py says what each is trained on).
The result is a draft directory in a published layout: z-lab's (config.json with dflash_config) for DFlash and
DFlash2, the speculators format for DSpark; model.safetensors beside it.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_onnx.artifacts.hub import resolve_checkpoint
from dflash_onnx.exporter.models.draft import DFlashDraft, DraftSpec, build_target_layer_ids
from dflash_onnx.exporter.models.draft_formats import KINDS, speculators_config
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.tokenizer import TextCodec
from dflash_onnx.training import blocks, checkpoint, data, objectives

SAVED_AWAY = ("embed_tokens", "lm_head")


CONFIDENCE_TARGETS = ("sampled", "greedy")


@dataclass
class DistillOptions:
    block_size: int = 16
    draft_layers: int = 1
    target_layer_ids: list[int] | None = None  # None: the reference's build_target_layer_ids
    steps: int | None = None
    time_budget_min: float | None = None
    seed: int = 0
    lr: float = 6e-4
    sequences_per_step: int = 4
    anchors_per_sequence: int = 32
    num_prompts: int = 256
    prompt_tokens: int = 32
    new_tokens: int = 96
    held_out: int = 16
    eval_every: int = 100
    checkpoint_every: int = 200
    mask_token_id: int | None = None
    gamma: float | None = None
    draft_type: str = "dflash"
    # DFlash2's sizes (speculators' defaults) and DSpark's heads; DSpark proposes from its anchor's slot too
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    # what DSpark's confidence head learns: sampled (speculators': the acceptance rate under rejection sampling,
    # the probability the draft gives the target's token) or greedy (whether the draft's greedy proposal is it)
    confidence_target: str = "sampled"

    def validate(self) -> None:
        if self.steps is None and self.time_budget_min is None:
            self.steps = 1000
        if self.block_size < 2:
            raise DFlashError(f"--block-size {self.block_size}: at least 2")
        least = self.block_size + (2 if self.draft_type == "dspark" else 1)  # DSpark proposes block_size tokens
        if self.new_tokens < least:
            raise DFlashError(f"--new-tokens {self.new_tokens} must be at least {least} for a {self.draft_type} "
                              f"draft of block size {self.block_size}")
        if self.draft_layers < 1:
            raise DFlashError("--draft-layers must be at least 1")
        if self.draft_type not in KINDS:
            raise DFlashError(f"--draft-type {self.draft_type}: choose one of {', '.join(KINDS)}")
        if self.confidence_target not in CONFIDENCE_TARGETS:
            raise DFlashError(f"--confidence-target {self.confidence_target}: choose one of "
                              f"{', '.join(CONFIDENCE_TARGETS)}")


def draft_config(target_config, options: DistillOptions, mask_token_id: int) -> dict:
    """config.json of a draft for this target, in the published (z-lab) layout."""
    text = target_config.get_text_config(decoder=True)
    layers = text.num_hidden_layers
    tapped = options.target_layer_ids or build_target_layer_ids(layers, options.draft_layers)
    if any(not 0 <= i < layers for i in tapped):
        raise DFlashError(f"--target-layers-tapped {tapped}: the target has layers 0..{layers - 1}")
    rope = getattr(text, "rope_parameters", None) or {}
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size, "intermediate_size": text.intermediate_size,
        "num_hidden_layers": options.draft_layers, "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        "max_position_embeddings": text.max_position_embeddings, "rms_norm_eps": text.rms_norm_eps,
        "attention_bias": bool(getattr(text, "attention_bias", False)), "num_target_layers": layers,
        "rope_theta": float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))),
        "tie_word_embeddings": False,
        "dflash_config": {"target_layer_ids": list(tapped), "block_size": options.block_size,
                          "mask_token_id": mask_token_id},
    }
    if options.draft_type == "dflash2":
        if config["hidden_size"] % options.conv_group_size:
            raise DFlashError(f"--conv-group-size {options.conv_group_size} must divide the hidden size "
                              f"{config['hidden_size']}")
        config["architectures"] = ["DFlash2DraftModel"]
        config["dflash_config"].update(conv_kernel_size=options.conv_kernel_size,
                                       conv_group_size=options.conv_group_size, selector_rank=options.selector_rank,
                                       selector_top_k=min(options.selector_top_k, text.vocab_size))
    if options.draft_type == "dspark":
        heads = dict(markov_rank=options.markov_rank, markov_head_type=options.markov_head_type,
                     enable_confidence_head=True, confidence_head_with_markov=options.markov_rank > 0)
        return speculators_config(config, "dspark", heads, sample_from_anchor=True, sliding_window_non_causal=False)
    return config


def initial_draft(lm, config: dict) -> DFlashDraft:
    """A draft whose layers start as the target's last layers and whose fc averages the tapped features."""
    spec = DraftSpec.from_dict(config)
    draft = DFlashDraft(spec, lm.get_input_embeddings().weight.detach(), lm.get_output_embeddings().weight.detach())
    decoder = lm.get_decoder()
    sources = decoder.layers[-len(draft.layers):]
    with torch.no_grad():
        for layer, source in zip(draft.layers, sources):
            mine, theirs = layer.state_dict(), source.state_dict()
            layer.load_state_dict({k: theirs[k] if k in theirs and theirs[k].shape == v.shape else v
                                   for k, v in mine.items()})
        draft.norm.weight.copy_(decoder.norm.weight)
        taps, hidden = len(spec.target_layer_ids), spec.config.hidden_size
        draft.fc.weight.copy_(torch.eye(hidden).repeat(1, taps) / taps)
        for name, parameter in draft.named_parameters():
            if name.endswith("base_kernel"):  # DFlash2's convolutions start as the identity
                parameter.zero_()[:, 0] = 1.0
            elif name.endswith("kernel_projection.weight") or name.endswith("markov_w2.weight"):
                parameter.zero_()  # no per-token kernel, no Markov bias yet: the draft starts as a DFlash one
            elif name.endswith(("predecessor_codebook", "successor_codebook")):
                parameter.normal_(0.0, 0.02)  # both zero would leave the pairwise term without a gradient
    return draft


def _features(lm, tapped: list[int], sequence: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        states = lm(input_ids=sequence[None], output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1][0] for i in tapped], dim=-1)


def held_out_tau(draft: DFlashDraft, examples: list[tuple[torch.Tensor, torch.Tensor, int]], block: int,
                 mask_id: int, max_anchors: int = 48) -> float:
    """Mean acceptance length of a step at every held-out anchor (up to max_anchors per sequence): 1 + the
    leading proposals of the kind's own greedy chain that equal the target's continuation."""
    lengths, count = [], objectives.proposals(draft)
    with torch.no_grad():
        for tokens, features, prompt_len in examples:
            anchors = torch.arange(prompt_len, len(tokens) - count)[:max_anchors]
            hidden = blocks.packed_hidden(draft, features, tokens, anchors, block, mask_id)
            proposed = objectives.proposed_ids(draft, hidden, tokens, anchors)
            lengths.append(blocks.acceptance_lengths(proposed, blocks.next_tokens(tokens, anchors, count)).float())
    return float(torch.cat(lengths).mean())


def _save_draft(draft: DFlashDraft, config: dict, out: Path, report: dict) -> None:
    from dflash_onnx.artifacts.publish import staged_directory

    with staged_directory(out) as tmp:
        state = {k: v.detach().contiguous() for k, v in draft.state_dict().items() if k not in SAVED_AWAY}
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "distill.json").write_text(json.dumps(report, indent=2) + "\n")


def distill(target_dir: Path, out: Path, options: DistillOptions, data_paths: list[Path] | None = None,
            prompts_file: Path | None = None, resume: bool = False, progress: bool = True,
            revision: str | None = None) -> dict:
    """Train a draft for the target in `target_dir` (a directory, or a Hugging Face hub name at `revision`, default
    main); write it to `out`; return the training report."""
    from tqdm import tqdm

    from dflash_onnx.exporter.pair import load_target

    options.validate()
    target_dir, out = Path(target_dir), Path(out)
    checkpoint_dir = out.with_name(out.name + ".ckpt")
    if out.exists() and not resume:
        raise DFlashError(f"{out} exists: choose a new --out (or --resume an interrupted run)")
    if checkpoint.exists(checkpoint_dir) and not resume:
        raise DFlashError(f"{checkpoint_dir} holds an interrupted run: pass --resume, or delete it")
    if not data_paths and not prompts_file:
        raise DFlashError("give training text: --data FILES_OR_DIRS or --prompts FILE")
    target_dir = resolve_checkpoint(target_dir, "target", revision, progress)
    torch.manual_seed(options.seed)
    generator = torch.Generator().manual_seed(options.seed)
    lm = load_target(target_dir, "float32")
    for parameter in lm.parameters():
        parameter.requires_grad_(False)
    codec = TextCodec(target_dir, artifact=False)
    vocab = lm.config.get_text_config(decoder=True).vocab_size
    mask_id = options.mask_token_id if options.mask_token_id is not None else codec.token_id("<mask>", vocab - 1)
    if prompts_file:
        prompts = data.prompts_from_lines(prompts_file, codec)
    else:
        prompts = data.prompts_from_files(data.text_files(data_paths), codec, options.num_prompts,
                                          options.prompt_tokens, generator)
    if len(prompts) <= options.held_out:
        raise DFlashError(f"{len(prompts)} prompts: need more than the {options.held_out} held out for tau")
    sequences = data.continuations(lm, target_dir, prompts, options.new_tokens, progress)
    config = draft_config(lm.config, options, mask_id)
    draft = initial_draft(lm, config)
    tapped, block = draft.spec.target_layer_ids, options.block_size
    # held-out features are kept; training features are computed when a sequence is drawn (a frozen target's
    # forward is cheap next to keeping [tokens, taps x hidden] floats for every training sequence)
    held_out = [(seq, _features(lm, tapped, seq), len(prompt))
                for seq, prompt in zip(sequences[: options.held_out], prompts[: options.held_out])]
    train = [(seq, len(prompt)) for seq, prompt in zip(sequences[options.held_out:], prompts[options.held_out:])]
    trainable = [p for n, p in draft.named_parameters() if n not in SAVED_AWAY]
    optimizer = torch.optim.AdamW(trainable, lr=options.lr, betas=(0.9, 0.95), weight_decay=0.01)
    count = objectives.proposals(draft)
    weights = blocks.loss_weights(count + 1, options.gamma or blocks.default_gamma(block))
    report = {"options": asdict(options), "draft_type": options.draft_type, "mask_token_id": mask_id,
              "target_layer_ids": tapped,
              "tau_before": held_out_tau(draft, held_out, block, mask_id), "history": []}
    step, total = 0, options.steps or 10**9
    if resume and checkpoint.exists(checkpoint_dir):
        meta = checkpoint.load(checkpoint_dir, draft, optimizer, generator)
        step, total, report = meta["step"], meta["total"], meta["report"]
    started = time.perf_counter()
    bar = tqdm(total=options.steps, initial=step, disable=not progress, desc="distill", unit="step", file=sys.stderr)
    draft.train()
    while step < total:
        horizon = total if total < 10**9 else 1000  # a time budget's length is known after 5 steps
        factor = blocks.cosine_with_warmup(step, horizon, max(1, horizon // 20))
        for group in optimizer.param_groups:
            group["lr"] = options.lr * factor
        loss = torch.zeros(())
        for index in torch.randint(len(train), (options.sequences_per_step,), generator=generator).tolist():
            tokens, prompt_len = train[index]
            features = _features(lm, tapped, tokens)
            anchors = blocks.sample_anchors(prompt_len, len(tokens) - 1 - count, options.anchors_per_sequence,
                                            generator)
            hidden = blocks.packed_hidden(draft, features, tokens, anchors, block, mask_id)
            loss = loss + objectives.draft_loss(draft, hidden, tokens, anchors, weights, options.confidence_target)
        loss = loss / options.sequences_per_step
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        step += 1
        bar.update(1)
        report.setdefault("first_loss", loss.item())  # the untrained draft's: what training must bring down
        postfix = {"loss": f"{loss.item():.3f}"}
        if step % options.eval_every == 0 or step == total:
            draft.eval()
            tau = held_out_tau(draft, held_out, block, mask_id)
            draft.train()
            report["history"].append({"step": step, "loss": loss.item(), "tau": tau})
            postfix["tau"] = f"{tau:.2f}"
        bar.set_postfix(postfix)
        if options.time_budget_min is not None and options.steps is None and step == 5:
            per_step = (time.perf_counter() - started) / 5
            total = max(10, int(options.time_budget_min * 60 / per_step))  # the schedule spans the budget
            bar.total = total
        if step % options.checkpoint_every == 0 and step < total:
            checkpoint.save(checkpoint_dir, {k: v for k, v in draft.state_dict().items() if k not in SAVED_AWAY},
                            optimizer, generator, {"step": step, "total": total, "report": report})
    bar.close()
    draft.eval()
    report.update(steps=step, seconds=round(time.perf_counter() - started, 1),
                  tau_after=held_out_tau(draft, held_out, block, mask_id))
    _save_draft(draft, config, out, report)
    shutil.rmtree(checkpoint_dir, ignore_errors=True)
    return report
