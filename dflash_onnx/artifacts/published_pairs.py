"""The published z-lab DFlash drafts and the targets they were trained for: the one table `export --draft NAME`
(target found from the draft) and `export --target NAME --draft auto` (draft found from the target) read. Data
only; a speculators-format draft names its target itself (its config's speculators_config.verifier).

Source: the "Supported Models" table of z-lab's README (github.com/z-lab/dflash, README.md at commit 0a2da2366b9b),
which lists each target by its short name and links its draft on the hub. The target repo ids are the ones that
README's own examples load (Qwen/Qwen3-8B, Qwen/Qwen3.5-4B, Qwen/Qwen3.5-27B, Qwen/Qwen3.5-35B-A3B, and
Qwen/Qwen3-Coder-30B-A3B-Instruct with z-lab/Qwen3-Coder-30B-A3B-DFlash in its earlier revisions), else the
publisher's repo of that short name. Block sizes are given where a source states them (the draft's name, "b16";
the README runs its Qwen3.5-4B, -27B and -35B-A3B drafts at block 16: `block_size=16`, `num_speculative_tokens:
15`, `--speculative-num-draft-tokens 16`); None where none we read does. The draft's config.json decides the
block at export either way: this column is only shown to the user. Every draft listed is DFlash, z-lab's layout.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedDraft:
    draft: str  # the draft's hub repo id
    target: str  # the target's hub repo id
    kind: str  # dflash, dflash2 or dspark
    block_size: int | None  # as published; None where no source we read states it


PUBLISHED = (
    PublishedDraft("z-lab/Qwen3-4B-DFlash-b16", "Qwen/Qwen3-4B", "dflash", 16),
    PublishedDraft("z-lab/Qwen3-8B-DFlash-b16", "Qwen/Qwen3-8B", "dflash", 16),
    PublishedDraft("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", "meta-llama/Llama-3.1-8B-Instruct", "dflash", None),
    PublishedDraft("z-lab/Qwen3-Coder-30B-A3B-DFlash", "Qwen/Qwen3-Coder-30B-A3B-Instruct", "dflash", None),
    PublishedDraft("z-lab/Qwen3-Coder-Next-DFlash", "Qwen/Qwen3-Coder-Next", "dflash", None),
    PublishedDraft("z-lab/gpt-oss-20b-DFlash", "openai/gpt-oss-20b", "dflash", None),
    PublishedDraft("z-lab/gpt-oss-120b-DFlash", "openai/gpt-oss-120b", "dflash", None),
    PublishedDraft("z-lab/Qwen3.5-4B-DFlash", "Qwen/Qwen3.5-4B", "dflash", 16),
    PublishedDraft("z-lab/Qwen3.5-9B-DFlash", "Qwen/Qwen3.5-9B", "dflash", None),
    PublishedDraft("z-lab/Qwen3.5-27B-DFlash", "Qwen/Qwen3.5-27B", "dflash", 16),
    PublishedDraft("z-lab/Qwen3.5-35B-A3B-DFlash", "Qwen/Qwen3.5-35B-A3B", "dflash", 16),
    PublishedDraft("z-lab/Qwen3.5-122B-A10B-DFlash", "Qwen/Qwen3.5-122B-A10B", "dflash", None),
    PublishedDraft("z-lab/Qwen3.6-27B-DFlash", "Qwen/Qwen3.6-27B", "dflash", None),
    PublishedDraft("z-lab/Qwen3.6-35B-A3B-DFlash", "Qwen/Qwen3.6-35B-A3B", "dflash", None),
    PublishedDraft("z-lab/Kimi-K2.5-DFlash", "moonshotai/Kimi-K2.5", "dflash", None),
)


def published_draft(draft: str) -> PublishedDraft | None:
    """The entry of a published draft (hub ids compare case-insensitively, as the hub does)."""
    return next((p for p in PUBLISHED if p.draft.casefold() == draft.casefold()), None)


def published_draft_for(target: str) -> PublishedDraft | None:
    """The published draft of a target; the first listed where there are several."""
    return next((p for p in PUBLISHED if p.target.casefold() == target.casefold()), None)


def described(entry: PublishedDraft) -> str:
    """'z-lab/Qwen3-4B-DFlash-b16 (dflash, block 16)'."""
    return f"{entry.draft} ({entry.kind}" + (f", block {entry.block_size})" if entry.block_size else ")")
