"""What a CoreML lowering will weigh, from the checkpoints' safetensors headers (nothing loaded or converted):
the packages' weights at the chosen precision, and the K/V state buffers a session allocates at --ctx-len.

The rules follow what the lowering writes: every checkpoint tensor stored once per package (a multifunction
package deduplicates its functions' weights), float16, or with --bits the tensors coremltools quantizes (2-D,
more than 2048 values: its weight_threshold) as `bits` per value plus a float16 scale per --group-size values.
The draft's embedding and lm_head are the target's: stored once in the one package of a whole lowering; in parts
(--layers-per-part) the draft's package holds its own copy, and a tied embedding is in the first and the last
part's package.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from dflash_onnx.artifacts.model_dirs import read_config, tensor_shapes
from dflash_onnx.targets.coreml.options import CoremlOptions
from dflash_onnx.targets.coreml.session import target_parts

QUANTIZED_FROM = 2048  # coremltools' default weight_threshold: smaller tensors stay float16


def _tensor_bytes(shape: list[int], bits: int | None, group_size: int) -> int:
    values = math.prod(shape)
    if bits and len(shape) == 2 and values > QUANTIZED_FROM:
        return values * bits // 8 + 2 * math.ceil(values / group_size)
    return 2 * values


def _state_bytes(config: dict, ctx_len: int) -> int:
    """K and V of every layer at ctx_len, float16."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return 2 * config["num_hidden_layers"] * kv_heads * ctx_len * head_dim * 2


def _draft_layers(draft_dir: Path) -> dict:
    """The draft's layer config, whichever layout its config.json has (a speculators draft nests it)."""
    raw = read_config(draft_dir, "draft")
    return raw.get("transformer_layer_config", raw) if "speculators_model_type" in raw else raw


def _vocab_tensors(shapes: dict[str, list[int]]) -> list[list[int]]:
    """The target's embedding and (when not tied) lm_head shapes."""
    return [shape for name, shape in shapes.items() if name.endswith(("embed_tokens.weight", "lm_head.weight"))]


def estimate(target_dir: Path, draft_dir: Path, options: CoremlOptions) -> dict:
    """Bytes of the packages' weights (target, draft) and of each graph's states, estimated from the headers."""
    shapes = {"target": tensor_shapes(target_dir), "draft": tensor_shapes(draft_dir)}
    text = read_config(Path(target_dir), "target")
    text = text.get("text_config", text)
    count = len(target_parts(text["num_hidden_layers"], options.layers_per_part))
    in_parts = count > 1
    vocab = _vocab_tensors(shapes["target"])
    copies = {"target": vocab[:1] if in_parts and len(vocab) == 1 else [], "draft": vocab if in_parts else []}
    weights = {kind: sum(_tensor_bytes(shape, options.bits, options.group_size)
                         for shape in [*shapes[kind].values(), *copies[kind]])
               for kind in ("target", "draft")}
    states = {"target": _state_bytes(text, options.ctx_len),
              "draft": _state_bytes(_draft_layers(Path(draft_dir)), options.ctx_len)}
    return {"method": "estimate from the checkpoints' headers (nothing converted)",
            "precision": f"int{options.bits}, blocks of {options.group_size}" if options.bits else "float16",
            "packages": f"target_part0..{count - 1}.mlpackage, draft.mlpackage" if in_parts else "model.mlpackage",
            "weights_bytes": weights, "package_bytes": sum(weights.values()), "state_bytes": states,
            "ctx_len": options.ctx_len}


def describe(found: dict) -> str:
    gib = 1024**3
    return (f"{found.get('packages', 'model.mlpackage')} ~{found['package_bytes'] / gib:.2f} GiB "
            f"({found['precision']}: target "
            f"{found['weights_bytes']['target'] / gib:.2f}, draft {found['weights_bytes']['draft'] / gib:.2f}); "
            f"K/V states at ctx_len {found['ctx_len']}: target {found['state_bytes']['target'] / gib:.2f} GiB, "
            f"draft {found['state_bytes']['draft'] / gib:.2f} GiB ({found['method']})")


# The peaks of a lowering in parts (docs/coreml.md#memory-and-time):
# one conversion per float16 byte of the modules it traces (the module, its TorchScript trace, the MIL program's
# constants, the int4 pass)
CONVERSION_PER_BYTE = 3.8
# combining a part's functions per float32 byte of their weights: ct.utils.save_multifunction holds each function's
# weights as float32 while it combines them
COMBINE_PER_FLOAT32 = 1.5
# the check, bytes per value of the largest function: the numpy evaluation's values (float16 weights dequantized,
# float32 copies for the matmuls) beside the float32 reference modules
CHECK_PER_VALUE = 15.0


def _module_values(target_dir: Path, draft_dir: Path, parts: list[tuple[int, int]]) -> tuple[int, int]:
    """Values in the largest target part's modules (its layers, plus the embedding or lm_head at the ends) and in
    the draft's (its layers plus its embedding and lm_head, the target's)."""
    target = tensor_shapes(target_dir)
    layers: dict[int, int] = {}
    for name, shape in target.items():
        found = re.search(r"layers\.(\d+)\.", name)
        if found:
            layers[int(found.group(1))] = layers.get(int(found.group(1)), 0) + math.prod(shape)
    vocab = max((math.prod(shape) for shape in _vocab_tensors(target)), default=0)
    part = max(sum(layers.get(i, 0) for i in range(start, stop)) + vocab * ((start == 0) + (stop == len(layers)))
               for start, stop in parts)
    return part, sum(math.prod(shape) for shape in tensor_shapes(draft_dir).values()) + 2 * vocab


def part_conversion_bytes(target_dir: Path, draft_dir: Path, parts: list[tuple[int, int]],
                          functions: tuple[int, int] = (3, 2)) -> int:
    """Peak memory of a lowering in parts (each part's modules loaded only while it is converted and checked),
    from the headers: the largest of a target part and the draft (`_module_values`), converted from float16 (how
    they are traced), combined as float32 with its `functions` (target part's, draft's) siblings, or checked in
    numpy (the check's reference, its weights and their rounded copies in float32, runs before), plus 1 GiB for
    the libraries."""
    values = _module_values(target_dir, draft_dir, parts)
    peaks = [max(CONVERSION_PER_BYTE * 2, COMBINE_PER_FLOAT32 * 4 * count, CHECK_PER_VALUE) * count_values
             for count_values, count in zip(values, functions)]
    return 2**30 + int(max(peaks))


def disk_bytes(target_dir: Path, draft_dir: Path, options: CoremlOptions, parts: list[tuple[int, int]],
               functions: tuple[int, int] = (3, 2)) -> int:
    """Peak disk of a lowering: the packages written (`estimate`), plus what waits to be combined, each function a
    package of its module's weights (in parts one part's functions, or the draft's; whole, every function of the
    pair), plus, with --bits, coremltools' float16 package of the largest module before it is quantized."""
    found = estimate(target_dir, draft_dir, options)
    per_value = options.bits / 8 + 2 / options.group_size if options.bits else 2.0
    part, draft = _module_values(target_dir, draft_dir, parts)
    if len(parts) > 1:
        waiting = max((functions[0] + 1) * part, (functions[1] + 1) * draft) * per_value
    else:
        waiting = functions[0] * found["weights_bytes"]["target"] + functions[1] * draft * per_value
    return int(1.1 * found["package_bytes"] + waiting + (2 * max(part, draft) if options.bits else 0))
