"""benchmarks/roofline.py: the bytes a decode step must read, counted from an ONNX graph and from a GGUF file, and the
whole report on a tiny lowering."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import benchmark_script
from onnx import TensorProto, helper, numpy_helper

roofline = benchmark_script("roofline")


def _graph_with(path, past_dims):
    """A token table only Gather reads (one row counts), a weight MatMul reads, a tied table both read (counted
    whole), and one layer's past K/V."""
    table = numpy_helper.from_array(np.zeros((10, 4), np.float32), "table")
    weight = numpy_helper.from_array(np.zeros((4, 6), np.float16), "weight")
    tied = numpy_helper.from_array(np.zeros((3, 4), np.float32), "tied")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["embedded"]),
             helper.make_node("MatMul", ["embedded", "weight"], ["projected"]),
             helper.make_node("Gather", ["tied", "ids"], ["again"]),
             helper.make_node("MatMul", ["embedded", "tied_t"], ["logits"]),
             helper.make_node("Transpose", ["tied"], ["tied_t"])]
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])]
    inputs += [helper.make_tensor_value_info(f"past_key_values.0.{kind}", TensorProto.FLOAT, past_dims)
               for kind in ("key", "value")]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
               for name in ("projected", "logits", "again")]
    graph = helper.make_graph(nodes, "g", inputs, outputs, [table, weight, tied])
    onnx.save(helper.make_model(graph), str(path))


def test_onnx_step_bytes_counts_one_row_of_a_gathered_table_and_kv_per_token(tmp_path):
    _graph_with(tmp_path / "target.onnx", ["batch", 2, "rows", 8])
    counted = roofline.onnx_step_bytes(tmp_path / "target.onnx")
    assert counted.weights == 4 * 4 + 4 * 6 * 2 + 3 * 4 * 4  # one float32 row, the float16 weight, the tied table
    assert counted.kv_per_token == 2 * 2 * 8 * 4  # key and value, 2 heads x 8 wide, float32
    assert counted.at(100) == counted.weights + 100 * counted.kv_per_token
    _graph_with(tmp_path / "other.onnx", ["batch", "heads", "rows", 8])  # not the buffer form's fixed heads
    with pytest.raises(SystemExit, match="past_key_values.0.key is not \\[batch, heads, rows, head_dim\\]"):
        roofline.onnx_step_bytes(tmp_path / "other.onnx")


def test_onnx_step_bytes_of_a_lowering_matches_its_checkpoint(exported, ort_lowered):
    """The lowering's count against the target checkpoint's own tensors: every weight once, of the token table one
    row; beside them the lowering holds its RoPE cache, and shares the norms' identical weights (all ones in the
    tiny pair), so the two agree within a few KB, far below the 24 KB the whole token table would add."""
    from safetensors import safe_open

    pair = exported("agree_b8")
    spec = pair.spec
    checkpoint = 0
    for path in pair.target_dir.glob("*.safetensors"):
        with safe_open(str(path), "np") as tensors:
            for name in tensors.keys():
                array = tensors.get_tensor(name)
                checkpoint += array.itemsize * (array.shape[-1] if name.endswith("embed_tokens.weight") else array.size)
    counted = roofline.onnx_step_bytes(ort_lowered("agree_b8") / "target.onnx")
    rope_cache = 2 * 512 * (spec.head_dim // 2) * 4  # cos and sin of ctx_len 512 positions, float32
    assert abs(counted.weights - (checkpoint + rope_cache)) <= 4096, (checkpoint, rope_cache, counted.weights)
    assert 4096 < (spec.vocab_size - 1) * spec.hidden_size * 4  # the table counted whole would fail the line above
    assert counted.kv_per_token == spec.target_layers * 2 * spec.num_kv_heads * spec.head_dim * 4


def test_gguf_step_bytes_reads_tensors_and_the_attention_shape(tmp_path):
    import gguf

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_embedding_length(16)
    writer.add_key_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((10, 16), np.float32))
    writer.add_tensor("output.weight", np.zeros((10, 16), np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((16, 16), np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    counted = roofline.gguf_step_bytes(path)
    assert counted.weights == 16 * 4 + 10 * 16 * 4 + 16 * 16 * 2  # one embedding row, the head, the projection
    assert counted.kv_per_token == 2 * 2 * 2 * 8 * 2  # layers x (key, value) x kv heads x key length x float16


def test_report_puts_the_measured_step_against_its_roofline(ort_lowered, capsys):
    roofline.main([str(ort_lowered("agree_b8")), "--context", "16", "--steps", "2", "--bandwidth-mib", "16"])
    printed = capsys.readouterr().out
    assert "read bandwidth, 2 threads" in printed
    row = next(line for line in printed.splitlines() if line.startswith("| ours"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    megabytes, limit, measured, share = float(cells[1]), float(cells[2]), float(cells[3]), cells[4]
    assert megabytes > 0 and limit > 0 and measured > 0
    assert abs(float(share.rstrip("%")) / 100 - measured / limit) < 0.01
