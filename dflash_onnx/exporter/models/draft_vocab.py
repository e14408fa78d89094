"""A draft that proposes from a reduced vocabulary (speculators' `draft_vocab_size` below the target's, with its
`t2d` / `d2t` tensors): its output head has one row per draft token, so a draft step's head costs draft_vocab /
vocab of a full one. The graph maps back to target ids itself: `draft_ids` are target ids, and the `logits` output
spans the target's vocabulary (-inf where the draft cannot propose), so every runtime and sampler reads a reduced
draft as it reads a full one.

speculators' convention: `t2d` [vocab] marks the target tokens the draft knows; `d2t` [draft_vocab] gives each
draft token's offset, its target id being `draft_id + d2t[draft_id]`; the reduced head is stored in the draft's
checkpoint as `lm_head.weight`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from dflash_onnx.artifacts.model_dirs import weight_files
from dflash_onnx.runtime.errors import DFlashError

MAP_KEYS = ("d2t", "t2d")
HEAD_KEY = "lm_head.weight"  # the reduced head, in the draft's own checkpoint


def read_draft_to_target(draft_dir: Path, draft_vocab: int, vocab: int) -> np.ndarray:
    """Each draft token's target id [draft_vocab] from the checkpoint's d2t and t2d, checked against each other
    and the config, and that the checkpoint holds the reduced head (both export paths then read it from there);
    one-line errors for what does not hold."""
    found: dict[str, np.ndarray] = {}
    head = False
    for file in weight_files(Path(draft_dir), "draft"):
        try:
            with safe_open(str(file), framework="pt") as handle:
                keys = set(handle.keys())
                found.update((key, handle.get_tensor(key).numpy()) for key in MAP_KEYS if key in keys)
                head = head or HEAD_KEY in keys
        except Exception as exc:  # safetensors raises several types for corrupt files
            raise DFlashError(f"cannot read draft weights {file}: {exc}") from None
    missing = [key for key in MAP_KEYS if key not in found]
    if missing:
        raise DFlashError(f"this draft proposes from {draft_vocab} of {vocab} tokens but its weights lack {missing}: "
                          "the vocabulary maps speculators saves beside a reduced-vocabulary draft")
    if not head:
        raise DFlashError(f"draft weights in {draft_dir} lack {HEAD_KEY}, the reduced-vocabulary head "
                          f"({draft_vocab} rows)")
    d2t, t2d = found["d2t"].astype(np.int64).reshape(-1), found["t2d"].astype(bool).reshape(-1)
    if d2t.shape != (draft_vocab,) or t2d.shape != (vocab,) or int(t2d.sum()) != draft_vocab:
        raise DFlashError(f"draft d2t {tuple(found['d2t'].shape)} / t2d {tuple(found['t2d'].shape)} (marking "
                          f"{int(t2d.sum())}) do not describe {draft_vocab} of {vocab} tokens")
    targets = np.arange(draft_vocab, dtype=np.int64) + d2t
    if targets.min() < 0 or targets.max() >= vocab or not np.array_equal(targets, np.flatnonzero(t2d)):
        raise DFlashError("draft d2t does not map its tokens onto the target tokens t2d marks (in order)")
    return targets


def target_columns(draft_to_target: np.ndarray, vocab: int) -> np.ndarray:
    """For each target token, the draft logit column that scores it, or draft_vocab (a column of -inf) where the
    draft cannot propose it: a Gather over [logits, -inf] spreads the draft's logits over the target's vocabulary."""
    columns = np.full(vocab, len(draft_to_target), dtype=np.int64)
    columns[draft_to_target] = np.arange(len(draft_to_target))
    return columns


def spread(logits: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Draft logits [..., draft_vocab] as logits over the target's vocabulary [..., vocab]."""
    padded = torch.cat([logits, torch.full_like(logits[..., :1], float("-inf"))], dim=-1)
    return padded.index_select(-1, columns)
