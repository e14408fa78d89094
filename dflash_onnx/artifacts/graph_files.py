"""ONNX graph files as the manifest describes them, and the draft's vocab tensors stored once.

Used by every writer of graph files (export, optimize, the ORT and AI 100 lowerings); onnx only.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnx

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import GraphSpec, TensorSpec
from dflash_onnx.runtime.paths import member

# the export's mixture-of-experts node: a model-local function of standard ops (dflash_onnx/exporter/models/experts.py)
# that
# the ORT lowering replaces by com.microsoft's MoE (passes/experts.py)
MOE_DOMAIN, MOE_OP = "dflash", "MoE"
SWIGLU_MOE_OP = "SwigluMoE"  # gpt-oss's biased, clamped-SwiGLU experts (dflash_onnx/exporter/models/swiglu_experts.py)
# gpt-oss's attention with sink logits (dflash_onnx/exporter/models/sink_attention.py)
SINK_ATTENTION_OP = "SinkAttention"
# Gemma 4's experts, routed by its own router (dflash_onnx/exporter/models/gelu_experts.py)
GELU_EXPERTS_OP = "GeluTanhExperts"
ONNX_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
               onnx.TensorProto.BFLOAT16: "bfloat16", onnx.TensorProto.INT64: "int64",
               onnx.TensorProto.INT32: "int32", onnx.TensorProto.INT8: "int8"}  # int8: an ORT lowering's K/V


def checked_graph(path: Path) -> onnx.ModelProto:
    """The structure of the graph file `path` (weights not loaded), every external-data location in it checked
    to be a plain name beside it: call before anything loads the graph's weights."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError and others for a damaged file
        raise DFlashError(f"{path} is not a readable ONNX graph ({str(exc).splitlines()[0] if str(exc) else exc!r}): "
                          "re-run the command that wrote it") from None
    tensors = list(model.graph.initializer)
    tensors += [a.t for n in model.graph.node for a in n.attribute if a.HasField("t")]
    for tensor in tensors:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = {e.key: e.value for e in tensor.external_data}.get("location", "")
            member(Path(path).parent, location, f"{Path(path).name}'s external data for {tensor.name}")
    return model


def _point_to(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _external_bytes(tensor: onnx.TensorProto) -> tuple[str, int, int]:
    info = {e.key: e.value for e in tensor.external_data}
    return info["location"], int(info.get("offset", 0)), int(info["length"])


def _read(out: Path, tensor: onnx.TensorProto) -> bytes:
    location, offset, length = _external_bytes(tensor)
    with open(member(out, location, "a graph's external data"), "rb") as handle:
        handle.seek(offset)
        return handle.read(length)


def _transposed(payload: bytes, tensor: onnx.TensorProto) -> bytes:
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return np.frombuffer(payload, dtype=dtype).reshape(tuple(tensor.dims)).T.tobytes()


# the draft's own vocabulary-sized weights (DFlash2's selector codebooks, DSpark's Markov factors): never a copy of
# the target's embedding or head, so never looked for in the target's graph
DRAFT_OWN_VOCAB_TENSORS = ("candidate_selector.", "markov_head.")


def share_initializers(
    out: Path, draft_file: str, target_file: str, vocab_size: int
) -> tuple[dict[str, str], list[str]]:
    """Point the draft's vocab-sized tensors (embedding, lm_head) at identical tensors in the
    target's data file, and rewrite the draft's data file without them.

    Matching is by content, so it survives the exporter renaming weights. When the exporter
    pre-transposed a weight in one graph only, the draft reads the target's copy through a
    Transpose node (ORT folds it at load), so the bytes are still stored once.
    Returns the vocab-sized draft tensors now shared (draft name -> the target tensor stored), and the names
    of those left unshared.
    """
    target = onnx.load(str(out / target_file), load_external_data=False)
    draft = onnx.load(str(out / draft_file), load_external_data=False)

    def vocab_sized(t: onnx.TensorProto) -> bool:
        own = t.name.startswith(DRAFT_OWN_VOCAB_TENSORS)
        return t.data_location == onnx.TensorProto.EXTERNAL and vocab_size in t.dims and not own

    def key(dims, data_type, payload: bytes):
        return tuple(dims), data_type, hashlib.sha256(payload).hexdigest()

    by_content = {key(t.dims, t.data_type, _read(out, t)): t for t in target.graph.initializer if vocab_sized(t)}
    shapes = {dims for dims, _, _ in by_content}

    def shareable(t: onnx.TensorProto) -> bool:
        """Vocab-sized and shaped like a target tensor (or its transpose): not one of the draft's own, such as
        DSpark's Markov factors [vocab, rank], which the exporter may rename when it transposes them."""
        return vocab_sized(t) and (tuple(t.dims) in shapes or tuple(t.dims)[::-1] in shapes)
    old_data, new_data = out / f"{draft_file}.data", out / f"{draft_file}.data.tmp"
    shared: dict[str, str] = {}
    unshared, transposes = [], []
    kept = []
    with open(new_data, "wb") as dst:
        for tensor in draft.graph.initializer:
            kept.append(tensor)
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            payload = _read(out, tensor)
            if shareable(tensor):
                same = by_content.get(key(tensor.dims, tensor.data_type, payload))
                flipped = None
                if same is None and len(tensor.dims) == 2:
                    flipped = by_content.get(key(tensor.dims[::-1], tensor.data_type, _transposed(payload, tensor)))
                if same is not None:
                    _point_to(tensor, *_external_bytes(same))
                    shared[tensor.name] = same.name
                    continue
                if flipped is not None:
                    source = onnx.TensorProto()
                    source.CopyFrom(flipped)
                    source.name = f"{tensor.name}.shared_transposed"
                    kept[-1] = source
                    transposes.append(onnx.helper.make_node("Transpose", [source.name], [tensor.name], perm=[1, 0]))
                    shared[tensor.name] = flipped.name
                    continue
                unshared.append(tensor.name)
            dst.seek((dst.tell() + 63) // 64 * 64)
            position = dst.tell()
            dst.write(payload)
            _point_to(tensor, f"{draft_file}.data", position, len(payload))
    os.replace(new_data, old_data)
    del draft.graph.initializer[:]
    draft.graph.initializer.extend(kept)
    for node in reversed(transposes):
        draft.graph.node.insert(0, node)
    onnx.save(draft, str(out / draft_file))
    return shared, unshared


def graph_spec(path: Path, num_layers: int, num_kv_heads: int, head_dim: int, kv_inputs: list[str],
               kv_outputs: list[str], **layers) -> GraphSpec:
    """Describe an exported graph file for the manifest; `layers`: GraphSpec's per-layer facts (recurrent,
    kv_shapes, kv_windows)."""
    inputs, outputs = graph_io(path)
    return GraphSpec(file=path.name, inputs=inputs, outputs=outputs, num_layers=num_layers, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, kv_inputs=kv_inputs, kv_outputs=kv_outputs, **layers)


def graph_io(path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The inputs and outputs of the graph file at `path`, as the manifest lists them."""
    model = onnx.load(str(path), load_external_data=False)

    def spec(value) -> TensorSpec:
        shape = [d.dim_param if d.dim_param else d.dim_value for d in value.type.tensor_type.shape.dim]
        return TensorSpec(value.name, ONNX_DTYPES.get(value.type.tensor_type.elem_type, "unknown"), shape)

    return [spec(v) for v in model.graph.input], [spec(v) for v in model.graph.output]




def graph_bytes(directory: Path, file: str) -> int:
    """The bytes of one graph's own files as they sit on disk: the graph and the external data files named after
    it (the draft's vocab tensors, stored once in the target's file, count with the target)."""
    path = Path(directory) / file
    model = onnx.load(str(path), load_external_data=False)
    locations = {entry.value for tensor in model.graph.initializer for entry in tensor.external_data
                 if entry.key == "location" and entry.value.startswith(file)}
    return path.stat().st_size + sum(member(Path(directory), location, f"{file}'s external data").stat().st_size
                                     for location in locations)
