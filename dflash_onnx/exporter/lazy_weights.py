"""Export without the weights in memory (issue 19).

The target and the draft are built with their parameters on torch's meta device and traced; each initializer of
the traced graph then becomes a lazy tensor that reads its checkpoint tensor from the safetensors file, converted
to the export dtype, only when the graph file is written. The writer takes the tensors one at a time and drops
each after writing it, so the export's peak memory is about its largest tensor, at any model size. Buffers
(RoPE frequencies) are computed, not stored: they stay real while the modules are built and are kept as values.
The trace itself runs on fake CPU tensors (no memory), so the graph is the one a loaded model gives.

Lowerings that must also run the pair before tracing it (the AI 100 and CoreML float16 calibrations) run the meta
pair with `weights_on_demand`: each module reads its own weights when it is called and drops them when it returns.
A conversion that needs real weights for a few modules at a time (CoreML in parts) takes them with
`weights_loaded` for its duration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx_ir as ir
import torch
from safetensors import safe_open
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode  # what torch.onnx's former enable_fake_mode used

from dflash_onnx.artifacts.model_dirs import file_tensor_shapes, weight_files
from dflash_onnx.exporter.models.draft import DFlashDraft
from dflash_onnx.exporter.models.draft_vocab import HEAD_KEY, MAP_KEYS
from dflash_onnx.exporter.models.target import TappedTarget
from dflash_onnx.runtime.errors import DFlashError

IR_DTYPES = {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16, torch.bfloat16: ir.DataType.BFLOAT16}


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside moves to the meta device as it is registered (nothing is allocated for
    it, and initializing it costs nothing); buffers stay real."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def buffer_values(module: nn.Module) -> dict[str, np.ndarray]:
    """`module`'s buffers by name, as numpy: the graph initializers traced from them (computed, not stored)."""
    return {name: buffer.detach().float().numpy().astype(_numpy_dtype(buffer.dtype))
            for name, buffer in module.named_buffers()}


def make_fake(module: nn.Module, mode: FakeTensorMode) -> None:
    """Make `module`'s parameters (on the meta device) and buffers fake CPU tensors of `mode`, ties kept. Traced on
    the meta device, SDPA takes another path than on CPU (the graph differs); fake CPU tensors trace exactly as real
    ones."""
    fakes: dict[int, torch.Tensor] = {}
    for submodule in module.modules():
        for name, param in submodule._parameters.items():
            if param is not None and id(param) not in fakes:
                with mode:
                    fakes[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype), requires_grad=False)
            if param is not None:
                submodule._parameters[name] = fakes[id(param)]
        for name, buffer in submodule._buffers.items():
            if buffer is not None:
                submodule._buffers[name] = mode.from_tensor(buffer)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if dtype == torch.bfloat16 else torch.empty((), dtype=dtype).numpy().dtype


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """`tensor` as numpy without a copy; bfloat16 (which numpy lacks) as ml_dtypes' bfloat16, bit for bit."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


class Checkpoint:
    """The tensors of a directory's safetensors files, known from their headers; read one at a time."""

    def __init__(self, directory: Path, kind: str):
        self.directory, self.kind = Path(directory), kind
        self.files: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in weight_files(self.directory, kind):
            for key, shape in file_tensor_shapes(file).items():
                self.files[key], self.shapes[key] = file, tuple(shape)


@dataclass(frozen=True)
class Source:
    """Where a parameter's value comes from: a checkpoint tensor, divided by `divisor` (a power-of-two scale
    folded into a weight: exact in any float dtype)."""

    checkpoint: Checkpoint
    key: str
    divisor: float = 1.0

    @property
    def shape(self) -> tuple[int, ...]:
        return self.checkpoint.shapes[self.key]

    @property
    def checkpoint_keys(self) -> tuple[str, ...]:
        return (self.key,)

    def read_stored(self) -> torch.Tensor:
        """The tensor as the checkpoint stores it; its file is mapped only while it is read."""
        with safe_open(str(self.checkpoint.files[self.key]), framework="pt") as handle:
            return handle.get_tensor(self.key)

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The tensor as `dtype`."""
        tensor = self.read_stored().to(dtype)
        return tensor / self.divisor if self.divisor != 1.0 else tensor

    def lazy(self, dtype: torch.dtype, name: str) -> ir.LazyTensor:
        """The tensor as `dtype`, read when the graph writer asks for its bytes."""
        return ir.LazyTensor(lambda: ir.Tensor(as_numpy(self.read(dtype)), name=name), dtype=IR_DTYPES[dtype],
                             shape=ir.Shape(self.shape), name=name)


@dataclass(frozen=True, eq=False)
class ConvertedSource:
    """A parameter transformers builds from several checkpoint tensors when it loads them (a mixture-of-experts
    layer's experts, stored one tensor per expert, fused into one): its checkpoint keys and the converter of
    transformers' own weight-conversion mapping, applied when the parameter is read."""

    checkpoint: Checkpoint
    target_key: str
    converter: object  # transformers.core_model_loading.WeightConverter, unused (each read works on a copy)
    parts: tuple[tuple[str, str], ...]  # (the converter's source pattern, checkpoint key), in loading order
    config: object
    shape: tuple[int, ...]

    def _convert(self, tensor: Callable[[str], torch.Tensor]) -> torch.Tensor:
        converter = deepcopy(self.converter)
        for pattern, key in self.parts:
            converter.add_tensor(self.target_key, key, pattern, partial(tensor, key))
        converted = converter.convert(self.target_key, config=self.config)[self.target_key]
        return converted[0] if isinstance(converted, list) else converted

    @property
    def checkpoint_keys(self) -> tuple[str, ...]:
        return tuple(key for _, key in self.parts)

    @property
    def key(self) -> str:
        """How a message names it: its first tensor and how many are converted into it."""
        return f"{self.parts[0][1]} (and {len(self.parts) - 1} more tensors, converted to {self.target_key})"

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The converted tensor as `dtype` (its parts read one file mapping at a time)."""
        def tensor(key: str) -> torch.Tensor:
            with safe_open(str(self.checkpoint.files[key]), framework="pt") as handle:
                return handle.get_tensor(key)

        return self._convert(tensor).to(dtype)

    def lazy(self, dtype: torch.dtype, name: str) -> ir.LazyTensor:
        return ir.LazyTensor(lambda: ir.Tensor(as_numpy(self.read(dtype)), name=name), dtype=IR_DTYPES[dtype],
                             shape=ir.Shape(self.shape), name=name)


@dataclass(frozen=True, eq=False)
class Mxfp4Source:
    """An expert weight a checkpoint stores in MXFP4 (gpt-oss: `{name}_blocks` [experts, rows, groups, 16] packed
    nibbles, `{name}_scales` [experts, rows, groups] power-of-two exponents), dequantized by transformers' own
    `convert_moe_packed_tensors` when the tensor is read: one tensor at a time, never the whole model."""

    checkpoint: Checkpoint
    name: str
    shape: tuple[int, ...]

    @property
    def checkpoint_keys(self) -> tuple[str, ...]:
        return (f"{self.name}_blocks", f"{self.name}_scales")

    @property
    def key(self) -> str:
        return f"{self.name}_blocks (MXFP4)"

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        blocks, scales = (Source(self.checkpoint, key).read_stored() for key in self.checkpoint_keys)
        return convert_moe_packed_tensors(blocks, scales, dtype=dtype)

    def lazy(self, dtype: torch.dtype, name: str) -> ir.LazyTensor:
        return ir.LazyTensor(lambda: ir.Tensor(as_numpy(self.read(dtype)), name=name), dtype=IR_DTYPES[dtype],
                             shape=ir.Shape(self.shape), name=name)


def mxfp4_sources(model: nn.Module, checkpoint: Checkpoint, prefix: str = "") -> dict[str, Mxfp4Source]:
    """`model`'s parameters the checkpoint stores as MXFP4 blocks and scales, by parameter name (under `prefix`);
    their dequantized shape checked against the parameter's."""
    found = {}
    for name, param in model.named_parameters():
        blocks, scales = f"{name}_blocks", f"{name}_scales"
        if name in checkpoint.files or blocks not in checkpoint.files or scales not in checkpoint.files:
            continue
        experts, rows, groups, width = checkpoint.shapes[blocks]
        shape = (experts, groups * width * 2, rows)  # dequantized, then [experts, inputs, outputs]
        if shape != tuple(param.shape) or checkpoint.shapes[scales] != (experts, rows, groups):
            raise DFlashError(f"{checkpoint.kind} tensors {blocks} {checkpoint.shapes[blocks]} and {scales} "
                              f"{checkpoint.shapes[scales]} in {checkpoint.directory} do not dequantize to "
                              f"{name}'s shape {tuple(param.shape)}: the checkpoint does not match its config.json")
        found[f"{prefix}{name}"] = Mxfp4Source(checkpoint, name, shape)
    return found


def converted_sources(model: nn.Module, checkpoint: Checkpoint) -> dict[str, WeightSource]:
    """`model`'s parameters (a transformers model, on the meta device) that transformers' weight-conversion
    mapping reads from tensors of other names (a multimodal checkpoint's model.language_model.*: a Source) or
    builds from several of `checkpoint`'s tensors (a ConvertedSource), by parameter name; converted shapes are the
    conversion's run on meta tensors, so a checkpoint that does not fit its config is refused before anything is
    read."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    names = dict(model.named_parameters())
    state = model.state_dict()
    parts: dict[str, list[tuple[str, str]]] = {}
    found: dict[str, WeightSource] = {}
    for key in sorted(checkpoint.files, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if pattern is not None and renamed in names:
            parts.setdefault(renamed, []).append((pattern, key))
        elif pattern is None and renamed != key and renamed in names:
            found[renamed] = Source(checkpoint, key)
    for name, keys in parts.items():
        converter = by_pattern[keys[0][0]]
        source = ConvertedSource(checkpoint, name, converter, tuple(keys), model.config, ())
        try:
            shape = tuple(source._convert(lambda key: torch.empty(checkpoint.shapes[key], device="meta")).shape)
        except Exception as exc:  # the conversion's own ops raise RuntimeError, ValueError ... on parts that misfit
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise DFlashError(f"{checkpoint.kind} tensors {source.key} in {checkpoint.directory} do not convert as "
                              f"transformers loads them ({first}): the checkpoint does not match its config.json"
                              ) from None
        found[name] = ConvertedSource(checkpoint, name, converter, tuple(keys), model.config, shape)
    return found


WeightSource = Source | ConvertedSource | Mxfp4Source


def parameter_sources(module: nn.Module, prefix: str, checkpoint: Checkpoint,
                      fixed: dict[str, WeightSource] | None = None, strict: bool = False,
                      ignored: tuple[str, ...] = ()) -> dict[str, WeightSource]:
    """Every parameter name of `module` (tied names included) -> its Source: a name in `fixed` reads what it says;
    a name under `prefix` reads the key that follows it; a parameter tied to others reads whichever of its names
    the checkpoint holds. Refuses a parameter the checkpoint lacks, a shape that differs from the config's, and,
    when `strict`, checkpoint tensors the module does not have (`ignored` apart)."""
    fixed = fixed or {}
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    found: dict[str, WeightSource] = {}
    for ident, aliases in names.items():
        source = next((fixed[alias] for alias in aliases if alias in fixed), None) or next(
            (Source(checkpoint, alias[len(prefix):]) for alias in aliases
             if alias.startswith(prefix) and alias[len(prefix):] in checkpoint.files), None)
        if source is None:
            raise DFlashError(f"{checkpoint.kind} weights in {checkpoint.directory} lack {aliases[0]} (tied names: "
                              f"{aliases}): the checkpoint does not match its config.json, or its tensors are "
                              "renamed when transformers loads them (then pass --no-stream: the pair is loaded whole)")
        shape = tuple(params[ident].shape)
        if source.shape != shape:
            raise DFlashError(f"{source.checkpoint.kind} tensor {source.key} in {source.checkpoint.directory} has "
                              f"shape {source.shape}, its config.json implies {shape}")
        found.update((alias, source) for alias in aliases)
    unknown = sorted(set(checkpoint.files) - {key for s in found.values() if s.checkpoint is checkpoint
                                                   for key in s.checkpoint_keys}
                     - set(ignored))
    if strict and unknown:
        raise DFlashError(f"{checkpoint.kind} weights in {checkpoint.directory} have {len(unknown)} unknown tensors, "
                          f"e.g. {unknown[:3]}")
    return found


def attach_weights(model: ir.Model, parameters: dict[str, WeightSource], buffers: dict[str, np.ndarray],
                   dtype: torch.dtype) -> None:
    """Give each initializer of a graph traced without weights its value: a lazy read of its checkpoint
    tensor (parameters, in `dtype`), or the buffer's computed value."""
    for name, value in model.graph.initializers.items():
        if name in parameters:
            value.const_value = parameters[name].lazy(dtype, name)
        elif name in buffers:
            value.const_value = ir.Tensor(buffers[name], name=name)
        else:
            raise DFlashError(f"the traced graph has a weight {name} that is neither a checkpoint tensor nor a "
                              "buffer: this architecture needs --no-stream (the pair loaded whole)")
    _fold_transposes(model)


def _fold_transposes(model: ir.Model) -> None:
    """A Transpose whose only input is a lazy weight read by nothing else becomes a lazy weight of its own (read,
    then transposed): the exporter's optimizer folds such Transposes whatever their size, and folding them itself
    would hold every transposed weight in memory at once."""
    initializers = model.graph.initializers
    for node in list(model.graph):
        source = node.inputs[0] if node.op_type == "Transpose" and node.domain == "" and node.inputs else None
        if source is None or source.name not in initializers or len(source.uses()) != 1 or \
                not isinstance(source.const_value, ir.LazyTensor):
            continue
        lazy, output = source.const_value, node.outputs[0]
        perm = node.attributes.get_ints("perm") or list(reversed(range(len(lazy.shape))))
        shape = ir.Shape([lazy.shape[i] for i in perm])
        folded = ir.Value(name=output.name, shape=shape, type=source.type,
                          const_value=ir.LazyTensor(_transposed(lazy, perm, output.name), dtype=lazy.dtype,
                                                    shape=shape, name=output.name))
        ir.convenience.replace_all_uses_with(output, folded)
        model.graph.remove(node, safe=True)
        del initializers[source.name]
        model.graph.register_initializer(folded)


def _transposed(lazy: ir.LazyTensor, perm: list[int], name: str) -> Callable[[], ir.Tensor]:
    def read() -> ir.Tensor:
        return ir.Tensor(np.ascontiguousarray(lazy.numpy().transpose(perm)), name=name)

    return read


@dataclass
class LazyWeights:
    """What the exporter needs to trace a module without weights: the fake mode its example inputs are made in,
    and the function that gives the traced graph's initializers their values."""

    mode: FakeTensorMode
    attach: Callable[[ir.Model], None]


def pair_sources(tapped: TappedTarget, draft: DFlashDraft, target_dir: Path,
                 draft_dir: Path) -> dict[int, WeightSource]:
    """id(parameter) -> Source for every parameter of a pair built by pair.meta_pair: the target's from its
    checkpoint (under the wrapper's `lm.`), the draft's strictly from its own, the shared embedding and lm_head from
    the target's (a draft's copies of them are ignored: the target's win)."""
    target = Checkpoint(target_dir, "target")
    converted = {f"lm.{name}": source for name, source in converted_sources(tapped.lm, target).items()}
    converted.update(mxfp4_sources(tapped.lm, target, prefix="lm."))
    target_sources = parameter_sources(tapped, "lm.", target, fixed=converted)

    def name_of(weight: torch.Tensor) -> str:
        return next(n for n, p in tapped.named_parameters(remove_duplicate=False) if p is weight)

    shared = {"embed_tokens": target_sources[name_of(tapped.lm.get_input_embeddings().weight)],
              "lm_head": target_sources[name_of(tapped.lm.get_output_embeddings().weight)]}
    checkpoint, ignored = Checkpoint(draft_dir, "draft"), ("embed_tokens.weight", "lm_head.weight")
    if draft.spec.draft_vocab is not None:  # a reduced-vocabulary draft's head is its own (draft_vocab.py)
        shared["lm_head"] = Source(checkpoint, HEAD_KEY)
        ignored = ("embed_tokens.weight", *MAP_KEYS)
    draft_sources = parameter_sources(draft, "", checkpoint, fixed=shared, strict=True, ignored=ignored)
    return {id(param): sources[name] for module, sources in ((tapped, target_sources), (draft, draft_sources))
            for name, param in module.named_parameters(remove_duplicate=False)}


def traced_weights(modules: list[nn.Module], sources: dict[int, WeightSource], dtype: torch.dtype) -> list[LazyWeights]:
    """The lazy weights of each of `modules` (a meta pair's modules, or wrappers around them whose own parameters
    `sources` also names), and makes them all fake for tracing, in one mode."""
    parameters = [{name: sources[id(param)] for name, param in module.named_parameters(remove_duplicate=False)}
                  for module in modules]
    buffers = [buffer_values(module) for module in modules]
    mode = FakeTensorMode()
    for module in modules:
        make_fake(module, mode)
    return [LazyWeights(mode, partial(attach_weights, parameters=p, buffers=b, dtype=dtype))
            for p, b in zip(parameters, buffers)]


def pair_weights(tapped: TappedTarget, draft: DFlashDraft, target_dir: Path, draft_dir: Path,
                 dtype: torch.dtype) -> tuple[LazyWeights, LazyWeights]:
    """For a pair built by pair.meta_pair: the lazy weights of the target graph and of the draft graph (see
    pair_sources). Makes both modules fake for tracing."""
    target, draft_weights = traced_weights([tapped, draft], pair_sources(tapped, draft, target_dir, draft_dir), dtype)
    return target, draft_weights


@contextmanager
def weights_on_demand(roots: list[nn.Module], sources: dict[int, WeightSource], dtype: torch.dtype) -> Iterator[None]:
    """Run meta modules for real: every module under `roots` that owns parameters reads them from their checkpoints
    (as `dtype`) when it is called and drops them when it returns, so a forward pass holds one module's weights at a
    time besides its callers' (the draft's root: the embedding and lm_head). Only calls load weights: code that
    reads a parameter outside its module's call sees the meta tensor."""
    modules = {id(module): module for root in roots for module in root.modules()}.values()
    owners = [(module, {name: p for name, p in module._parameters.items() if p is not None}) for module in modules]
    owners = [(module, own) for module, own in owners if own]

    def load(own: dict[str, nn.Parameter]) -> Callable:
        def hook(module: nn.Module, _args) -> None:
            module._parameters.update({name: nn.Parameter(sources[id(p)].read(dtype), requires_grad=False)
                                       for name, p in own.items()})
        return hook

    def drop(own: dict[str, nn.Parameter]) -> Callable:
        def hook(module: nn.Module, _args, _output) -> None:
            module._parameters.update(own)
        return hook

    handles = [handle for module, own in owners
               for handle in (module.register_forward_pre_hook(load(own)), module.register_forward_hook(drop(own)))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, own in owners:
            module._parameters.update(own)


@contextmanager
def weights_loaded(modules: list[nn.Module], sources: dict[int, WeightSource], dtype: torch.dtype) -> Iterator[None]:
    """Every parameter under `modules` in `dtype` for the duration, put back after: those on the meta device read
    from their checkpoints, real ones cast. What a conversion (or a run) of only these modules needs."""
    owners = {id(module): module for root in modules for module in root.modules()}.values()
    kept = [(module, dict(module._parameters)) for module in owners]
    # parameters read from the same tensor (tied ones) share its storage; each stays its own Parameter, as when
    # loaded (torch.jit.trace refuses a Parameter object held by two modules)
    real: dict[Source | ConvertedSource | int, torch.Tensor] = {}
    try:
        for module, own in kept:
            for name, param in own.items():
                if param is None or (param.device.type != "meta" and param.dtype == dtype):
                    continue
                key = sources[id(param)] if param.device.type == "meta" else id(param)
                if key not in real:
                    real[key] = key.read(dtype) if not isinstance(key, int) else param.detach().to(dtype)
                module._parameters[name] = nn.Parameter(real[key], requires_grad=False)
        yield
    finally:
        for module, own in kept:
            module._parameters.update(own)
