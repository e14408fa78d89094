"""Training state on disk as safetensors + JSON: resuming reads tensors and plain data, never a pickle (a
planted or tampered checkpoint cannot run code), and a checkpoint is replaced whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_onnx.artifacts.publish import staged_directory
from dflash_onnx.runtime.errors import DFlashError

TENSORS, META = "state.safetensors", "state.json"


def exists(directory: Path) -> bool:
    return (Path(directory) / META).is_file() or (Path(directory) / TENSORS).is_file()


def save(directory: Path, draft_state: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
         generator: torch.Generator, meta: dict) -> None:
    """The draft's trainable tensors, the optimizer's moments and the sampling generator (tensors), with
    `meta` and the optimizer's hyperparameters (JSON)."""
    tensors = {f"draft.{name}": value.detach().contiguous() for name, value in draft_state.items()}
    state = optimizer.state_dict()
    for index, entries in state["state"].items():
        for key, value in entries.items():
            value = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"optimizer.{index}.{key}"] = value.contiguous()
    tensors["generator"] = generator.get_state()
    with staged_directory(directory, overwrite=True) as tmp:
        save_file(tensors, str(tmp / TENSORS))
        (tmp / META).write_text(json.dumps({**meta, "param_groups": state["param_groups"]}) + "\n")


def load(directory: Path, draft: torch.nn.Module, optimizer: torch.optim.Optimizer,
         generator: torch.Generator) -> dict:
    """Restore what `save` wrote into `draft`, `optimizer` and `generator`; returns the meta."""
    directory = Path(directory)
    try:
        tensors = load_file(str(directory / TENSORS))
        meta = json.loads((directory / META).read_text())
    except Exception as exc:  # safetensors and json raise their own types for a damaged file
        raise DFlashError(f"the checkpoint in {directory} is damaged ({exc}): delete it and train again") from None
    saved = {k.removeprefix("draft."): v for k, v in tensors.items() if k.startswith("draft.")}
    own = draft.state_dict()
    trained = {name for name, parameter in draft.named_parameters() if parameter.requires_grad}
    differing = {k for k, v in saved.items() if k not in own or own[k].shape != v.shape} | (trained - set(saved))
    differing = sorted(differing)
    if differing:
        raise DFlashError(f"the checkpoint in {directory} was saved for another draft ({len(differing)} tensors "
                          f"differ, e.g. {differing[0]}): resume with the options it was started with (--draft-type "
                          "and the sizes), or delete it")
    draft.load_state_dict(saved, strict=False)
    moments: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            moments.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": moments, "param_groups": meta.pop("param_groups")})
    generator.set_state(tensors["generator"])
    return meta
