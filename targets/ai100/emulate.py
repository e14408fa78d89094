"""Float16 device emulation: the AI 100 graphs as `-convert-to-fp16` computes them, run on ONNX Runtime.

Every float32 tensor the device would hold in float16 (graph inputs, weights, every node's output) is rounded
through float16 (values past 65504 become inf, as on the device), except the outputs of the nodes the
precision plan keeps in float32. The check compares these graphs with the float32 ones: the K/V each call
writes, the logits and the context rows at positions up to ctx_len - 1, and whole greedy and DFlash decodes,
token for token. MXFP6 weights and MXINT8 K/V are not emulated: their rounding is the compiler's.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from dflash_onnx.runtime.decode import Decoder
from dflash_onnx.runtime.differences import scaled_difference
from dflash_onnx.runtime.feeds import sampling_feeds
from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.targets.ai100.compiler import smallest_covering
from dflash_onnx.targets.ai100.options import Ai100Options


def _float32_values(model: onnx.ModelProto) -> set[str]:
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    values = [*graph.input, *graph.value_info, *graph.output]
    names = {v.name for v in values if v.type.tensor_type.elem_type == TensorProto.FLOAT}
    return names | {t.name for t in graph.initializer if t.data_type == TensorProto.FLOAT}


def _round_trip(name: str, rounded: str) -> list[onnx.NodeProto]:
    return [helper.make_node("Cast", [name], [f"{rounded}__f16"], to=TensorProto.FLOAT16),
            helper.make_node("Cast", [f"{rounded}__f16"], [rounded], to=TensorProto.FLOAT)]


def emulated_graph(model: onnx.ModelProto, keep_fp32: set[str], round_to_fp16: bool = True) -> onnx.ModelProto:
    """A copy of `model` (loaded without its weights) computing as the float16 device would, with the logits
    (the first ArgMax's or TopK's input) exposed as an output; `round_to_fp16=False` gives the float32 twin."""
    graph = model.graph
    floats = _float32_values(model) if round_to_fp16 else set()
    sources = [v.name for v in graph.input] + [t.name for t in graph.initializer]
    renamed = {name: f"{name}__rounded" for name in sources if name in floats}
    nodes = [n for name, new in renamed.items() for n in _round_trip(name, new)]
    for node in graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.input[:] = [renamed.get(name, name) for name in node.input]
        rounded = [o for o in node.output if o in floats and o not in keep_fp32]
        copy.output[:] = [f"{o}__exact" if o in rounded else o for o in node.output]
        nodes.append(copy)
        for output in rounded:
            nodes += _round_trip(f"{output}__exact", output)
    # the logits: the first ArgMax's input (DFlash; DSpark's first slot, biased by its Markov head) or TopK's
    # (DFlash2's selector takes each position's top-k before its chain's ArgMaxes)
    argmax = next(n for n in graph.node if n.op_type in ("ArgMax", "TopK"))
    emulated = onnx.ModelProto()
    emulated.CopyFrom(model)
    del emulated.graph.node[:]
    emulated.graph.node.extend(nodes)
    emulated.graph.output.append(helper.make_tensor_value_info(argmax.input[0], TensorProto.FLOAT, None))
    return emulated


class GraphSession:
    """A Session over one graph proto whose weights stay in the lowered directory: the graph is written there
    under a hidden name for as long as ONNX Runtime takes to load it (ORT reads external data only from the
    graph's own directory)."""

    retains_state = False

    def __init__(self, model: onnx.ModelProto, weights_dir: Path, name: str):
        path = Path(weights_dir) / f".{name}.emulation-{os.getpid()}.onnx"
        onnx.save(model, str(path))
        try:
            options = ort.SessionOptions()
            options.log_severity_level = 4
            options.enable_cpu_mem_arena = False  # each call's whole-context K/V would otherwise stay reserved
            self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        finally:
            path.unlink(missing_ok=True)
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]
        self.logits_name = model.graph.output[-1].name

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
        names = output_names or self.output_names
        return dict(zip(names, self._session.run(names, {k: v for k, v in feeds.items() if k in self.input_names})))


def open_twin(directory: Path, fp32_outputs: dict[str, list[str]], device: bool) -> dict[str, GraphSession]:
    """The target and draft as float32 graphs (`device` False) or as their float16 emulation, by graph name."""
    sessions = {}
    for graph in ("target", "draft"):
        model = onnx.load(str(Path(directory) / f"{graph}.onnx"), load_external_data=False)
        keep = set(fp32_outputs.get(graph, []))
        sessions[graph] = GraphSession(emulated_graph(model, keep, round_to_fp16=device), directory,
                                       f"{graph}.{'fp16' if device else 'fp32'}")
    return sessions


def _probe_feeds(manifest: Manifest, graph: str, position: int, lengths: list[int], rng) -> dict[str, np.ndarray]:
    """One call at `position`: a block of random tokens (and, for the draft, a block of context rows before it)
    over buffers of random K/V, rounded to float16 so both twins read the same values."""
    spec, block = getattr(manifest, graph), manifest.block_size
    shape = (1, spec.num_kv_heads, int(manifest.ctx_len), spec.head_dim)
    feeds = {name: rng.standard_normal(shape).astype(np.float16).astype(np.float32) for name in spec.kv_inputs}
    ids = rng.integers(0, manifest.vocab_size, (1, block)).astype(np.int64)
    positions = np.arange(position, position + block, dtype=np.int64)[None]
    feeds["comp_ctx_lengths"] = np.zeros(smallest_covering(lengths, position + block), np.int64)
    if graph == "target":
        return {**feeds, "input_ids": ids, "position_ids": positions}
    context = rng.standard_normal((1, block, manifest.draft_hidden_size)).astype(np.float16).astype(np.float32)
    return {**feeds, "input_ids": ids, "position_ids": positions, "context_hidden": context,
            "ctx_position_ids": positions - block, **sampling_feeds(spec)}


def _probe_outputs(sessions: dict[str, GraphSession], manifest: Manifest, graph: str, position: int,
                   lengths: list[int], seed: int = 0) -> dict[str, np.ndarray]:
    """One call at `position` on one twin: its logits, the K/V rows it writes, and (target) its context rows."""
    rng = np.random.default_rng(seed + position)
    feeds = _probe_feeds(manifest, graph, position, lengths, rng)
    spec, session = getattr(manifest, graph), sessions[graph]
    names = [session.logits_name, *spec.kv_outputs] + (["context_hidden"] if graph == "target" else [])
    outputs = session.run(feeds, names)
    slots = slice(position - manifest.block_size if graph == "draft" else position, position + manifest.block_size)
    return {name: value[:, :, slots].copy() if name in spec.kv_outputs else value for name, value in outputs.items()}


def _probe_report(manifest: Manifest, graph: str, position: int, logits: str, want: dict, got: dict) -> dict:
    """Relative errors of the emulated call (`got`) against the float32 one (`want`)."""
    spec = getattr(manifest, graph)
    keys = [n for n in spec.kv_outputs if ".key" in n or "_key" in n]
    report = {"position": position,
              "k": max(scaled_difference(want[n], got[n]) for n in keys),
              "v": max(scaled_difference(want[n], got[n]) for n in spec.kv_outputs if n not in keys),
              "logits": scaled_difference(want[logits], got[logits]),
              "argmax_agree": float(np.mean(got[logits].argmax(-1) == want[logits].argmax(-1)))}
    if graph == "target":
        report["context"] = scaled_difference(want["context_hidden"], got["context_hidden"])
    return report


def probe_positions(ctx_len: int, block: int, count: int = 6) -> list[int]:
    """Call positions from the start to the last block that fits (its last row at ctx_len - 2, the scratch
    slot ctx_len - 1 excepted), spread evenly."""
    last = ctx_len - 1 - block
    return sorted({block, *(int(round(block + (last - block) * i / (count - 1))) for i in range(count))})


def emulation_check(directory: Path, manifest: Manifest, options: Ai100Options, fp32_outputs: dict[str, list[str]],
                    prompts: list[list[int]], new_tokens: int, positions: list[int] | None = None) -> dict:
    """The float16 emulation report of a lowered directory: error curves over position per graph, and greedy on
    the float32 graphs against greedy and DFlash on the emulated ones, token for token. One twin's sessions are
    open at a time (the float32 outputs are kept, the K/V only at the rows each call writes)."""
    if manifest.dtype != "float32":
        return {"skipped": f"the graphs are {manifest.dtype} already: ONNX Runtime runs them at that precision"}
    lengths = options.compute_context_lengths()
    positions = positions or probe_positions(int(manifest.ctx_len), manifest.block_size)
    runs = {}
    for device in (False, True):
        sessions = open_twin(directory, fp32_outputs, device)
        outputs = {graph: [_probe_outputs(sessions, manifest, graph, p, lengths) for p in positions]
                   for graph in ("target", "draft")}
        decoder = Decoder(manifest, sessions["target"], sessions["draft"])
        modes = ("greedy", "dflash") if device else ("greedy",)
        tokens = {mode: [decoder.generate(prompt, new_tokens, mode, stop_token_ids=[], verify="full").tokens
                         for prompt in prompts] for mode in modes}
        runs[device] = outputs, tokens, {g: s.logits_name for g, s in sessions.items()}
        del sessions, decoder
    (exact, want, logits), (emulated, got, _) = runs[False], runs[True]
    curves = {graph: [_probe_report(manifest, graph, p, logits[graph], e, d)
                      for p, e, d in zip(positions, exact[graph], emulated[graph])] for graph in ("target", "draft")}
    decode = {"prompts": len(prompts), "new_tokens": new_tokens,
              "last_position": max(len(p) for p in prompts) + new_tokens - 1,
              **{f"{mode}_identical": sum(g == w for g, w in zip(got[mode], want["greedy"]))
                 for mode in ("greedy", "dflash")}}
    return {"curves": curves, "decode": decode,
            "not_emulated": "MXFP6 weights and MXINT8 K/V (the compiler's rounding)"}
