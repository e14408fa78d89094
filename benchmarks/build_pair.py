"""Rebuild the shipped demo pair from scratch: a byte-level Qwen3 target trained on the Python standard
library, and its DFlash draft distilled with `dflash-onnx distill`. Seeded; CPU only.

    python benchmarks/build_pair.py [--target-minutes 35] [--draft-minutes 20] [--out dflash_onnx/demo_pair]

Files are split into train and held-out by a hash of their path (1 in 20 held out), so the demo's prompts
come from files neither model saw. Both models are written as float16 safetensors. Work files (checkpoints,
logs) go to OUT/../demo_work; an interrupted run resumes from there.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SPECIALS = ["<|endoftext|>", "<pad>", "<mask>"]
TARGET = {"vocab_size": 256 + len(SPECIALS), "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "eos_token_id": 256, "bos_token_id": 256,
          "pad_token_id": 257}
SKIP_DIRS = ("test", "tests", "idle_test", "site-packages", "__pycache__")


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(train, held_out): the interpreter's own Python sources, split by a hash of the relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not set(p.relative_to(root).parts) & set(SKIP_DIRS))
    held = [p for p in files if zlib.crc32(str(p.relative_to(root)).encode()) % 20 == 0]
    return [p for p in files if p not in held], held


def write_tokenizer(directory: Path) -> None:
    """Bytes 0..255 are ids 0..255 (GPT-2's byte-to-unicode symbols, no merges); specials follow."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_symbol = _bytes_to_unicode()
    vocab = {byte_symbol[b]: b for b in range(256)}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<pad>",
        "mask_token": "<mask>", "model_max_length": TARGET["max_position_embeddings"]}, indent=2))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (the ByteLevel pre-tokenizer's alphabet)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes)}


def train_target(files: list[Path], out: Path, work: Path, minutes: float, seed: int) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    data = torch.tensor(list(b"\n\n".join(p.read_bytes() for p in files)), dtype=torch.long)
    model = Qwen3ForCausalLM(Qwen3Config(**TARGET))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    state_path, step, log = work / "target_state.pt", 0, []
    if state_path.is_file():
        state = torch.load(state_path, weights_only=True)  # tensors and plain data only: no code runs
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, log = state["step"], state["log"]
    generator = torch.Generator().manual_seed(seed + step)
    seq, batch = 256, 16
    started, spent = time.perf_counter(), sum(e["seconds"] for e in log[-1:])
    estimated_total = None
    model.train()
    while time.perf_counter() - started + spent < minutes * 60:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
        windows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        if estimated_total is None and step >= 20:
            per_step = (time.perf_counter() - started + spent) / step
            estimated_total = int(minutes * 60 / per_step)
        horizon = estimated_total or 10**6
        lr = 2e-3 * min(1.0, (step + 1) / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, step / horizon))))
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(input_ids=windows[:, :-1], labels=windows[:, :-1]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 25 == 0:
            log.append({"step": step, "loss": round(loss.item(), 4),
                        "seconds": round(time.perf_counter() - started + spent, 1)})
            print(f"target step {step} loss {loss.item():.3f} ({log[-1]['seconds']:.0f} s)", file=sys.stderr,
                  flush=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "log": log},
                       state_path)
    model.eval()
    model.half().save_pretrained(str(out))
    return {"steps": step, "log": log[-3:], "train_bytes": int(len(data))}


def held_out_loss(target_dir: Path, files: list[Path], samples: int = 32) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    data = torch.tensor(list(b"\n\n".join(p.read_bytes() for p in files)), dtype=torch.long)
    generator = torch.Generator().manual_seed(1)
    starts = torch.randint(0, len(data) - 257, (samples,), generator=generator)
    with torch.no_grad():
        windows = torch.stack([data[s : s + 256] for s in starts.tolist()])
        return float(model(input_ids=windows, labels=windows).loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shipped = Path(__file__).resolve().parents[1] / "dflash_onnx" / "demo_pair"
    parser.add_argument("--out", type=Path, default=shipped)
    parser.add_argument("--target-minutes", type=float, default=35)
    parser.add_argument("--draft-minutes", type=float, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=512, help="distillation prompts (64 bytes each)")
    parser.add_argument("--new-tokens", type=int, default=160, help="target continuation per prompt")
    parser.add_argument("--redistill", action="store_true",
                        help="keep the shipped target (OUT/target) and distill a new draft for it")
    args = parser.parse_args()
    from dflash_onnx.training.distill import DistillOptions, distill

    train, held = stdlib_files()
    work = args.out.parent / "demo_work"
    work.mkdir(parents=True, exist_ok=True)
    target_dir, draft_dir = work / "target", work / "draft"
    if args.redistill and not (target_dir / "model.safetensors").is_file():
        shutil.copytree(args.out / "target", target_dir)
    began = time.perf_counter()
    if not (target_dir / "model.safetensors").is_file():
        report = train_target(train, target_dir, work, args.target_minutes, args.seed)
        write_tokenizer(target_dir)
        (target_dir / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": TARGET["eos_token_id"], "pad_token_id": TARGET["pad_token_id"]}))
        (work / "target_report.json").write_text(json.dumps(report, indent=2))
    target_minutes = (time.perf_counter() - began) / 60
    print(f"target held-out loss {held_out_loss(target_dir, held):.3f} nats/byte", file=sys.stderr)
    if not (draft_dir / "model.safetensors").is_file():
        options = DistillOptions(block_size=16, draft_layers=1, target_layer_ids=[1, 3],
                                 time_budget_min=args.draft_minutes, seed=args.seed, lr=1e-3,
                                 num_prompts=args.num_prompts, prompt_tokens=64, new_tokens=args.new_tokens,
                                 held_out=24, eval_every=50,
                                 mask_token_id=256 + SPECIALS.index("<mask>"))
        distill(target_dir, draft_dir, options, data_paths=train, resume=(work / "draft.ckpt").exists())
        weights = load_file(str(draft_dir / "model.safetensors"))
        save_file({k: v.half() for k, v in weights.items()}, str(draft_dir / "model.safetensors"))
    if args.out.exists():
        shutil.rmtree(args.out)
    shutil.copytree(target_dir, args.out / "target")
    shutil.copytree(draft_dir, args.out / "draft")
    (args.out / "draft" / "build.json").write_text(json.dumps(
        {"num_prompts": args.num_prompts, "new_tokens": args.new_tokens, "draft_minutes": args.draft_minutes,
         "redistill": args.redistill}, indent=1) + "\n")
    (args.out / "held_out_files.json").write_text(json.dumps(
        [str(p.relative_to(Path(sysconfig.get_paths()["stdlib"]))) for p in held], indent=1))
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file()) / 2**20
    print(f"wrote {args.out} ({size:.1f} MiB) in {(time.perf_counter() - began) / 60:.1f} min "
          f"(target {target_minutes:.1f} min)", file=sys.stderr)


if __name__ == "__main__":
    main()
