"""Runs of a plan's pure device nodes traced once per shape and run through `mx.compile`.

Building a call node by node costs Python time per node (about 1 us of walking plus the op's own call);
mlx-lm's native model spends about as much per layer on its module calls. Between two attentions the fused
graph is a fixed chain (o_proj, residual + RMSNorm, the MLP, the next layer's q/k/v and their norms): each
such run becomes one compiled function, which MLX replays from its trace (cached per input shapes, so once
per call size) and whose elementwise ops it fuses. The attention stays eager: it reads K/V up to a length
that changes every call, which a trace would fix.

A run may read: activations (its arguments), weights (constants of the trace), and host values that depend
only on shapes (Shape and what is computed from it alone: fixed for a given call size, like the trace).
Anything derived from a feed's values (positions, lengths) ends a run.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

# ops a run may hold: MLX ops of their inputs alone, nothing read from an input's values on the host
COMPILABLE = {("", "MatMul"), ("com.microsoft", "FusedMatMul"), ("", "SimplifiedLayerNormalization"),
              ("com.microsoft", "SimplifiedLayerNormalization"), ("com.microsoft", "SkipSimplifiedLayerNormalization"),
              ("", "Sigmoid"), ("", "Mul"), ("", "Add"), ("", "Sub"), ("", "Div"), ("", "Neg"), ("", "Tanh"),
              ("", "Exp"), ("", "Softmax"), ("", "Reshape"), ("", "Transpose"),
              ("dflash.mlx", "RotaryHeads"), ("dflash.mlx", "SeqFirst")}
SHAPE_OPS = {"Shape"}
SHORTEST = 4  # shorter runs stay eager: a compiled call has its own fixed cost
TRACES = 16  # a run traced for more call shapes than this (its host values change every call) runs eagerly


def shape_only(nodes: list, keys: list[tuple[str, str]], constants: set[str]) -> set[str]:
    """Names whose values depend only on shapes: constants, Shape outputs, and what host ops compute from them."""
    static = set(constants)
    for (_, inputs, outputs, _, _), (_, op) in zip(nodes, keys):
        if op in SHAPE_OPS or all(not i or i in static for i in inputs):
            static.update(outputs)
    return static


def _compiled(nodes: list, arguments: list[str], captured: dict, results: list[str]) -> Callable:
    """One compiled function of the run's activations; `captured` holds the call's shape-only host values,
    read while tracing (the same for every call of one shape)."""
    def run(*arrays):
        values = {**captured, **dict(zip(arguments, arrays)), "": None}
        for op, inputs, outputs, attrs, _ in nodes:
            values.update(zip(outputs, op([values[i] for i in inputs], attrs)))
        return [values[name] for name in results]

    return mx.compile(run)


def segmented(plan: list, keys: list[tuple[str, str]], constants: dict, static: set[str],
              wanted: tuple[str, ...]) -> list:
    """`plan` with each run of at least SHORTEST compilable nodes replaced by one step of the same form
    (run, inputs, outputs, attrs, label) that calls the run's compiled function."""
    consumers: dict[str, int] = {}
    for index, (_, inputs, _, _, _) in enumerate(plan):
        for name in inputs:
            consumers[name] = index  # the last reader
    steps, run = [], []

    def close() -> None:
        if len(run) < SHORTEST:
            steps.extend(plan[i] for i in run)
        else:
            steps.append(_step([plan[i] for i in run], run[-1], consumers, constants, static, wanted))
        run.clear()

    for index, key in enumerate(keys):
        if key in COMPILABLE:
            run.append(index)
        else:
            close()
            steps.append(plan[index])
    close()
    return steps


def _step(nodes: list, last: int, consumers: dict[str, int], constants: dict, static: set[str],
          wanted: tuple[str, ...]) -> tuple:
    produced = {name for node in nodes for name in node[2]}
    read = [name for node in nodes for name in node[1] if name and name not in produced]
    arguments = list(dict.fromkeys(n for n in read if n not in constants and n not in static))
    host = list(dict.fromkeys(n for n in read if n in static and n not in constants))
    results = [n for n in dict.fromkeys(name for node in nodes for name in node[2])
               if n and (consumers.get(n, -1) > last or n in wanted)]
    captured = {n: constants[n] for n in read if n in constants}
    traced: dict[tuple, Callable] = {}

    def eager(inputs: list) -> list:
        values = {**captured, **dict(zip(arguments + host, inputs)), "": None}
        for op, node_inputs, outputs, node_attrs, _ in nodes:
            values.update(zip(outputs, op([values[i] for i in node_inputs], node_attrs)))
        return [values[n] for n in results]

    def call(inputs: list, attrs: dict) -> list:
        arrays, host_values = inputs[: len(arguments)], inputs[len(arguments):]
        if len(traced) > TRACES or not all(type(a) is mx.array for a in arrays):  # host activations, or host
            return eager(inputs)  # values that change call by call (a draft's masks): node by node
        key = (tuple(tuple(a.shape) for a in arrays),
               tuple((np.shape(v), np.asarray(v).tobytes()) for v in host_values))
        if key not in traced:  # one compiled function per call shape and host values (fixed in its trace)
            traced[key] = _compiled(nodes, arguments, {**captured, **dict(zip(host, host_values))}, results)
        return traced[key](*arrays)

    label = f"compiled run of {len(nodes)} nodes ({nodes[0][4]} .. {nodes[-1][4]})"
    return call, arguments + host, results, {}, label
