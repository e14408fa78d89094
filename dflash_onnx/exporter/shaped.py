"""Random-weight pairs of published model shapes (Qwen3-4B, LLaMA-3.1-8B), written tensor by tensor.

A 4B model in float32 would not fit in a 24 GB machine's memory, so nothing here builds the model: the
parameter names and shapes come from the model classes instantiated on PyTorch's meta device (no storage),
and each tensor is drawn from its own seeded generator, cast to the checkpoint dtype and written into
safetensors shards of at most `shard_bytes`, with the index file `from_pretrained` reads. Peak memory is
one shard. Values follow the HF initialisation (normal(0, 0.02), norms 1), so the pair runs like an
untrained model; the draft's embedding and lm_head are the target's, as in the published drafts.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
INIT_STD = 0.02
DRAWN_ROWS = 8192  # rows drawn in float32 at a time: a whole vocab-sized matrix is 1.5 GB in float32 at Qwen3-4B


def _meta_shapes(module: torch.nn.Module, skip: set[str]) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of a module built on the meta device (tied parameters once)."""
    shapes, seen = {}, set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if name in skip or id(param) in seen:
            continue
        seen.add(id(param))
        shapes[name] = tuple(param.shape)
    return shapes


def _tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """One parameter, the same for the same (name, seed) whatever else the checkpoint holds."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    rows = []  # drawn in float32 DRAWN_ROWS at a time
    for start in range(0, shape[0], DRAWN_ROWS):
        part = (min(DRAWN_ROWS, shape[0] - start), *shape[1:])
        rows.append(torch.empty(part).normal_(0.0, INIT_STD, generator=generator).to(dtype))
    return torch.cat(rows) if len(rows) > 1 else rows[0]


# MXFP4 (gpt-oss's experts): 32 values per group, each a 4-bit FP4 code, two codes a byte, and one power-of-two
# exponent per group stored with a bias of 127. Random codes over all 16 values have a spread of ~2.6; an exponent
# of -7 scales that to ~0.02, the HF initialisation's.
MXFP4_GROUP, MXFP4_SCALE = 32, 127 - 7


def mxfp4_names(name: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors a checkpoint stores for parameter `name` [experts, inputs, outputs] in MXFP4: `{name}_blocks`
    [experts, outputs, groups, 16] packed codes and `{name}_scales` [experts, outputs, groups] exponents."""
    experts, inputs, outputs = shape
    groups = inputs // MXFP4_GROUP
    return {f"{name}_blocks": ((experts, outputs, groups, MXFP4_GROUP // 2), torch.uint8),
            f"{name}_scales": ((experts, outputs, groups), torch.uint8)}


def _stored(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
            mxfp4: set[str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor the checkpoint holds, in order, with its stored shape and dtype."""
    stored = {}
    for name, shape in shapes.items():
        stored.update(mxfp4_names(name, shape) if name in mxfp4 else {name: (shape, dtype)})
    return stored


def _packed(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """MXFP4 blocks (random codes) or scales (the fixed exponent) for one parameter."""
    if name.endswith("_scales"):
        return torch.full(shape, MXFP4_SCALE, dtype=torch.uint8)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def _shards(stored: dict[str, tuple[tuple[int, ...], torch.dtype]], shard_bytes: int) -> list[list[str]]:
    """Names grouped in order into shards of at most `shard_bytes` (a larger tensor gets a shard alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in stored.items():
        nbytes = torch.empty((), dtype=dtype).element_size() * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_checkpoint(directory: Path, shapes: dict[str, tuple[int, ...]], dtype: str, seed: int,
                     shard_bytes: int, progress: bool = False, mxfp4: set[str] = frozenset()) -> Iterator[str]:
    """Write the tensors of `shapes` as safetensors shards (plus model.safetensors.index.json when there
    are several), one shard in memory at a time; yields each file written. Parameters named in `mxfp4` are stored
    as MXFP4 blocks and scales, as gpt-oss checkpoints store their experts."""
    stored = _stored(shapes, DTYPES[dtype], set(mxfp4))
    groups = _shards(stored, shard_bytes)
    weight_map, total = {}, 0
    for index, names in enumerate(groups, 1):
        file = "model.safetensors" if len(groups) == 1 else f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        shard = {name: _packed(name, shape, seed) if kind == torch.uint8 else _tensor(name, shape, kind, seed)
                 for name in names for shape, kind in [stored[name]]}
        total += sum(t.numel() * t.element_size() for t in shard.values())
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del shard
        yield file
    if len(groups) > 1:
        index_file = directory / "model.safetensors.index.json"
        index_file.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        yield index_file.name


def target_shapes(config) -> dict[str, tuple[int, ...]]:
    """The HF causal LM's parameters for `config`, without allocating them."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    skip = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    return _meta_shapes(model, skip)


def draft_shapes(raw_config: dict) -> dict[str, tuple[int, ...]]:
    """The DFlash draft body's parameters (its embedding and lm_head are the target's, not stored)."""
    from dflash_onnx.exporter.models.draft import DFlashDraft, DraftSpec

    spec = DraftSpec.from_dict(raw_config)
    vocab, hidden = raw_config["vocab_size"], raw_config["hidden_size"]
    with torch.device("meta"):
        embed = torch.empty(vocab, hidden)
        draft = DFlashDraft(spec, embed, embed)
    return _meta_shapes(draft, {"embed_tokens", "lm_head"})
