"""The weights an MLX lowering with --bits reads quantized, dequantized back into the ONNX initializers they came
from, for the check's reference: the graph the MLX session runs, on ONNX Runtime, with those initializers
replaced, so the check compares float arithmetic only and keeps its float tolerance at 4 and 8 bits (compared
with the unrounded export, int4 rounding alone moves a random-weight model's logits by tens of percents of their
scale, more than a wrong rewrite would).

A weight stored quantized one way (`NAME.q.*`: mx.quantize of W for x @ W; `NAME.qt.*`: of W for x @ W^T and
row lookups) has one rounded value; one stored both ways, or also kept float for another reader, has none that
every reader of the ONNX graph would see, and is reported so the check knows its reference is not exact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_onnx.runtime.manifest import Manifest
from dflash_onnx.targets.mlx.session import import_mlx


def rounded_initializers(directory: Path, manifest: Manifest, graph: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """(initializer name -> its dequantized value in the initializer's layout and the dtype it was quantized
    from; the names read more than one way, left unrounded) for `graph` of the MLX lowering in `directory` (the
    draft's names shared with the target's included)."""
    mx = import_mlx()
    from dflash_onnx.targets.mlx.ops import as_numpy

    directory = Path(directory)
    stores = {name: mx.load(str(directory / f"{name}.safetensors")) for name in {"target", graph}}
    quantized = {key.rsplit(".", 2)[0] for key in stores[graph] if key.endswith((".q.w", ".qt.w"))}
    places = {name: (stores[graph], name) for name in quantized}
    if graph == "draft":
        places.update({name: (stores["target"], key) for name, key in manifest.lowering.shared_with_target.items()})
    options = manifest.lowering.options
    rounded, mixed = {}, []
    for name, (store, key) in places.items():
        forms = [suffix for suffix in ("q", "qt") if f"{key}.{suffix}.w" in store]
        if not forms:
            continue
        if len(forms) > 1 or key in store:
            mixed.append(name)
            continue
        suffix = forms[0]
        value = mx.dequantize(store[f"{key}.{suffix}.w"], store[f"{key}.{suffix}.scales"],
                              store[f"{key}.{suffix}.biases"], group_size=options["group_size"], bits=options["bits"])
        value = as_numpy(value)  # the scales' dtype: the weight's before quantization
        rounded[name] = np.ascontiguousarray(value.T if suffix == "q" else value)
    return rounded, mixed
