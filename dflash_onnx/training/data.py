"""Training text for a draft: the target's own greedy continuations of prompts, cached on disk.

DFlash drafts learn to predict what the target will say, so the sequences are prompt + the target's greedy
continuation. Prompts come from a file (one per line) or from random windows of text files.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.tokenizer import TextCodec

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".js", ".ts", ".rs", ".go", ".java")


def text_files(paths: list[Path]) -> list[Path]:
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise DFlashError(f"--data {path} does not exist")
    if not files:
        raise DFlashError(f"--data {', '.join(map(str, paths))}: no text files ({', '.join(TEXT_SUFFIXES)})")
    return files


def prompts_from_files(files: list[Path], codec: TextCodec, count: int, prompt_tokens: int,
                       generator: torch.Generator) -> list[list[int]]:
    """`count` windows of `prompt_tokens` tokens at random places of random files."""
    prompts, attempts = [], 0
    while len(prompts) < count and attempts < 20 * count:
        attempts += 1
        path = files[int(torch.randint(len(files), (1,), generator=generator))]
        text = path.read_text(errors="ignore")
        if len(text) < 8:
            continue
        start = int(torch.randint(max(1, len(text) - 8 * prompt_tokens), (1,), generator=generator))
        ids = codec.encode(text[start : start + 16 * prompt_tokens])[:prompt_tokens]
        if len(ids) == prompt_tokens:
            prompts.append(ids)
    if not prompts:
        raise DFlashError(f"no prompt of {prompt_tokens} tokens found in the --data files")
    return prompts


def prompts_from_lines(path: Path, codec: TextCodec) -> list[list[int]]:
    lines = [line.rstrip("\n") for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise DFlashError(f"--prompts {path} has no non-empty lines")
    return [codec.encode(line.replace("\\n", "\n")) for line in lines]


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_ONNX_CACHE", Path.home() / ".cache" / "dflash-onnx")) / "distill"


def continuations(target, target_dir: Path, prompts: list[list[int]], new_tokens: int, progress: bool = True,
                  batch_size: int = 64) -> list[torch.Tensor]:
    """prompt + greedy continuation per prompt, cached by (target weights, prompts, new_tokens); prompts of
    equal length are generated `batch_size` at a time."""
    digest = hashlib.sha256()
    for file in sorted(Path(target_dir).glob("*.safetensors")):
        digest.update(file.name.encode() + str(file.stat().st_size).encode() + str(file.stat().st_mtime_ns).encode())
    digest.update(repr((prompts, new_tokens)).encode())
    path = cache_dir() / f"{digest.hexdigest()[:24]}.safetensors"
    if path.is_file():
        try:
            cached = load_file(str(path))
            return [cached[f"sequence.{i}"] for i in range(len(cached))]
        except Exception:  # a damaged or foreign cache file is regenerated, never trusted
            path.unlink(missing_ok=True)
    sequences: list[torch.Tensor | None] = [None] * len(prompts)
    by_length: dict[int, list[int]] = {}  # prompts of one length run as one batch: no padding, same tokens
    for index, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(index)
    done = 0
    with torch.no_grad():
        for indices in by_length.values():
            for begin in range(0, len(indices), batch_size):
                batch = indices[begin : begin + batch_size]
                ids = torch.tensor([prompts[i] for i in batch])
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
                for row, index in enumerate(batch):
                    sequences[index] = out[row]
                done += len(batch)
                if progress:
                    print(f"\rgenerating training text with the target: {done}/{len(prompts)}", end="",
                          file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    save_file({f"sequence.{i}": s.contiguous() for i, s in enumerate(sequences)}, str(partial))
    partial.replace(path)
    return sequences
