"""How close a one-token decode step comes to the memory roofline. A decode step of a model whose weights do not fit
in cache must read every weight once, one row of each embedding table and the K/V of its context: those bytes over
the machine's read bandwidth (measured here, on `--threads` threads, over 1 GiB) are the fastest a decode can run.
The step is timed here too, one row, unprofiled, its K/V bound in place as the runtime binds them, in rounds
alternating with the bandwidth's, and put against that figure. `--gguf FILE` counts a llama.cpp model file the same
way (its K/V cache float16, llama.cpp's default), so a peer's measured rate (`--peer-tok-s`, e.g. `bench --peers
llama.cpp`'s llama-bench row) gets its own fraction.

The count is of the tensors the graph holds: ONNX Runtime may repack some at load (MatMulNBits keeps its float32
scales, and for int8 activations a float32 sum per block beside them), so it can read more than the count says. It
is for dense targets: a mixture-of-experts step reads only the experts its token chose, which the count does not
know.

    python benchmarks/roofline.py DIR [--context 256] [--threads 2] [--steps 32] [--bandwidth-mib 1024]
        [--gguf FILE [--peer-tok-s X]]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_profile import bind_in_place, step_feeds  # noqa: E402

from dflash_onnx.figures import markdown_table, provenance  # noqa: E402


@dataclass(frozen=True)
class StepBytes:
    """What one decode step reads: the weights and one embedding row per table, and K/V per token of context."""

    weights: int
    kv_per_token: int

    def at(self, context: int) -> int:
        return self.weights + self.kv_per_token * context


def read_seconds(words: np.ndarray, threads: int) -> float:
    """Seconds `threads` threads take to read `words` together: each ORs its share down to one word (numpy
    releases the GIL inside the reduction)."""
    workers = [threading.Thread(target=np.bitwise_or.reduce, args=(share,)) for share in np.array_split(words, threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - start


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
    return count * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def onnx_step_bytes(path: Path) -> StepBytes:
    """A buffer-form target graph's step: every initializer once, except a table only Gather nodes index (the
    token embedding), which costs one row; K/V per token from its past buffers ([batch, heads, rows, head_dim])."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    weights = 0
    for tensor in graph.initializer:
        nodes = readers.get(tensor.name, [])
        size = _tensor_bytes(tensor)
        gathered = nodes and all(n.op_type == "Gather" and n.input[0] == tensor.name for n in nodes)
        weights += size // tensor.dims[0] if gathered and tensor.dims else size
    kv = 0
    for value in graph.input:
        if value.name.startswith("past_key_values."):
            dims = value.type.tensor_type.shape.dim
            if len(dims) != 4 or not (dims[1].dim_value and dims[3].dim_value):
                raise SystemExit(f"{path}: {value.name} is not [batch, heads, rows, head_dim] with fixed heads and "
                                 "head_dim (roofline reads the buffer form's K/V)")
            itemsize = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).itemsize
            kv += itemsize * dims[1].dim_value * dims[3].dim_value
    if not kv:
        raise SystemExit(f"{path}: no past_key_values inputs (roofline reads buffer-form targets: lower --target ort)")
    return StepBytes(weights, kv)


def gguf_step_bytes(path: Path, kv_itemsize: int = 2) -> StepBytes:
    """A llama.cpp model file's step: every tensor once, except token_embd where a separate output head exists
    (then one row); K/V per token from its layer count and attention shape."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise SystemExit("--gguf needs the gguf package (pip install gguf)") from None
    reader = GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    weights = 0
    for tensor in reader.tensors:
        rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1  # ggml's shape is [columns, rows]
        one_row = tensor.name == "token_embd.weight" and "output.weight" in names
        weights += int(tensor.n_bytes) // rows if one_row else int(tensor.n_bytes)
    arch = _field(reader, "general.architecture")
    layers, kv_heads = _field(reader, f"{arch}.block_count"), _field(reader, f"{arch}.attention.head_count_kv")
    head_dim = _field(reader, f"{arch}.attention.key_length", None)
    if head_dim is None:
        head_dim = _field(reader, f"{arch}.embedding_length") // _field(reader, f"{arch}.attention.head_count")
    return StepBytes(weights, 2 * layers * kv_heads * head_dim * kv_itemsize)


def _field(reader, key: str, default: object = ...):
    field = reader.get_field(key)
    if field is None:
        if default is ...:
            raise SystemExit(f"the GGUF file has no {key}")
        return default
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types and field.types[0].name == "STRING" else int(value[0])


def measure(directory: Path, context: int, steps: int, threads: int, size: int, rounds: int = 8) -> tuple[float, float]:
    """The read bandwidth (bytes/s) and the median milliseconds of a one-row decode call at `context` (K/V bound in
    place; threads spin within a call only), in interleaved rounds: a neighbour on the machine's memory lowers both
    alike, and the bandwidth kept is the fastest round's (the roofline is what the memory can give)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = threads, 3
    options.add_session_config_entry("session.force_spinning_stop", "1")  # no spinning thread beside the reads
    session = ort.InferenceSession(str(directory / "target.onnx"), options, providers=["CPUExecutionProvider"])
    binding = bind_in_place(session, step_feeds(session, context, 1))
    words = np.ones(size // 8, np.uint64)
    for _ in range(2):  # warm-up: prepacking, allocations
        session.run_with_iobinding(binding)
    warm_until = time.perf_counter() + 1.0
    while time.perf_counter() < warm_until:  # the array's pages, and a second of reads: the memory's clocks rise
        read_seconds(words, threads)  # under sustained load (here 46 GB/s idle, 64 GB/s after)
    fastest, times = float("inf"), []
    for _ in range(rounds):
        fastest = min(fastest, read_seconds(words, threads))
        for _ in range(max(1, steps // rounds)):
            start = time.perf_counter()
            session.run_with_iobinding(binding)
            times.append(time.perf_counter() - start)
    return words.nbytes / fastest, 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="an ORT lowering (buffer form)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--bandwidth-mib", type=int, default=1024, help="the array read to measure bandwidth; "
                        "well above the last-level cache")
    parser.add_argument("--gguf", type=Path, help="a llama.cpp model file to count the same way")
    parser.add_argument("--peer-tok-s", type=float, help="the llama.cpp file's measured decode rate")
    args = parser.parse_args(argv)
    ours = onnx_step_bytes(args.directory / "target.onnx")
    bandwidth, measured = measure(args.directory, args.context, args.steps, args.threads, args.bandwidth_mib << 20)
    rows = [_row(f"ours ({args.directory.name}), one row", ours.at(args.context), bandwidth, 1000 / measured)]
    if args.gguf:
        rows.append(_row(f"llama.cpp ({args.gguf.name})", gguf_step_bytes(args.gguf).at(args.context), bandwidth,
                         args.peer_tok_s))
    print(f"read bandwidth, {args.threads} threads: {bandwidth / 1e9:.1f} GB/s; context {args.context} tokens")
    print(markdown_table(["decode step", "MB read per token", "roofline tok/s", "measured tok/s", "of roofline"],
                         rows))
    print()
    print(provenance())


def _row(name: str, nbytes: int, bandwidth: float, measured: float | None) -> list[str]:
    roofline = bandwidth / nbytes
    return [name, f"{nbytes / 1e6:.1f}", f"{roofline:.1f}", "-" if measured is None else f"{measured:.1f}",
            "-" if measured is None else f"{measured / roofline:.0%}"]


if __name__ == "__main__":
    main()
