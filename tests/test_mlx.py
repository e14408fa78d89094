"""The MLX backend (mlx[cpu] here): the lowered graphs decode exactly like ONNX Runtime and the reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import KV_BUFFER, benchmark_script
from reference import (  # skips the module when the oracle is missing
    DFlashDraftModel,
    dflash_model,
)
from transformers import AutoModelForCausalLM

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets import LowerRequest, open_decoder

mx = pytest.importorskip("mlx.core", reason="MLX is not installed: pip install 'mlx[cpu]' (Linux) or mlx (macOS)")

from dflash_onnx.targets.mlx.lower import lower_mlx  # noqa: E402
from dflash_onnx.targets.mlx.options import MlxOptions  # noqa: E402
from dflash_onnx.targets.mlx.session import MlxSession  # noqa: E402


@pytest.fixture(scope="session")
def mlx_lowered(exported, tmp_path_factory):
    """The MLX lowering of a pair: the fused buffer form where the ORT lowering takes it (conftest.KV_BUFFER: not
    a sliding-window target), else the exported graphs op by op."""
    cache = {}

    def get(name: str, bits: int | None = None, group_size: int = 32, kv_buffer: bool | None = None):
        kv_buffer = KV_BUFFER[name] if kv_buffer is None else kv_buffer
        key = (name, bits, group_size, kv_buffer)
        if key not in cache:
            out = tmp_path_factory.mktemp("mlx") / f"{name}_{bits}_{kv_buffer}"
            lower_mlx(exported(name).out, out, MlxOptions(bits, group_size, kv_buffer, ctx_len=512),
                      LowerRequest(progress=False))
            cache[key] = out
        return cache[key]

    return get


def _prompts(n, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab - 1, size=int(rng.integers(1, 12))).tolist() for _ in range(n)]


@pytest.mark.parametrize("name,kv_buffer", [("agree_b8", True), ("agree_b8", False), ("causal_gqa4_b4", False),
                                            ("llama_sliding_b16", True), ("agree_b4_fp16", True)])
def test_mlx_decodes_exactly_like_ort(name, kv_buffer, exported, decoders, mlx_lowered):
    mlx, ort = open_decoder(mlx_lowered(name, kv_buffer=kv_buffer), backend="mlx"), decoders(name)
    assert mlx.manifest.form == ("buffer" if kv_buffer else "concat")
    for prompt in _prompts(5, exported(name).spec.vocab_size, seed=1):
        for mode in ("dflash", "greedy"):
            ours = mlx.generate(prompt, 24, mode, stop_token_ids=[], verify="full")  # the same steps as the export
            want = ort.generate(prompt, 24, mode, stop_token_ids=[])
            assert ours.tokens == want.tokens and ours.acceptance_lengths == want.acceptance_lengths
        assert mlx.generate(prompt, 24, stop_token_ids=[]).tokens == want.tokens  # auto: the same tokens


def test_mlx_buffers_grow_with_the_context_and_decode_like_ort(decoders, mlx_lowered):
    """The buffer form's K/V start empty, take FIRST_ROWS rows on the first call and double past them (up to
    ctx_len 512), the rows written before kept: a 300-token prompt decodes the export's tokens across the growth."""
    from dflash_onnx.targets.kv_rows import FIRST_ROWS

    mlx = open_decoder(mlx_lowered("agree_b8"), backend="mlx")
    target, draft = mlx.target.state, mlx.draft.state
    assert {a.shape[2] for a in target.arrays.values()} == {0} == {a.shape[1] for a in draft.arrays.values()}
    short = [5, 9, 2, 7]
    assert mlx.generate(short, 8, "dflash", stop_token_ids=[]).tokens == \
        decoders("agree_b8").generate(short, 8, "greedy", stop_token_ids=[]).tokens
    assert {a.shape[2] for a in target.arrays.values()} == {FIRST_ROWS}
    prompt = np.random.default_rng(8).integers(2, 94, size=300).tolist()
    for mode in ("dflash", "greedy"):
        assert mlx.generate(prompt, 24, mode, stop_token_ids=[]).tokens == \
            decoders("agree_b8").generate(prompt, 24, "greedy", stop_token_ids=[]).tokens
    assert {a.shape[2] for a in target.arrays.values()} == {512} == {a.shape[1] for a in draft.arrays.values()}


def test_mlx_equals_the_reference(exported, mlx_lowered):
    pair = exported("causal_gqa4_b4")  # causal draft: every step, the tail included, matches the reference
    target = AutoModelForCausalLM.from_pretrained(str(pair.target_dir), attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(str(pair.draft_dir)).eval()
    decoder = open_decoder(mlx_lowered("causal_gqa4_b4"), backend="mlx")
    for prompt in _prompts(4, pair.spec.vocab_size, seed=2):
        ref = dflash_model.dflash_generate(draft, target, torch.tensor(prompt)[None], 24, None, return_stats=True)
        ours = decoder.generate(prompt, 24, "dflash", stop_token_ids=[], verify="full")
        assert ours.tokens == ref.output_ids[0, len(prompt):].tolist()
        assert ours.acceptance_lengths == ref.acceptance_lengths


def test_graph_outputs_match_ort(exported, decoders, mlx_lowered):
    ort = decoders("agree_b8")
    session = MlxSession(mlx_lowered("agree_b8", kv_buffer=False), load_manifest(mlx_lowered("agree_b8",
                                                                                        kv_buffer=False)), "target")
    spec = ort.manifest.target
    feeds = {"input_ids": np.array([[5, 9, 11, 3]]), "position_ids": np.arange(4)[None],
             **{n: np.zeros((1, 0, spec.num_kv_heads, spec.head_dim), np.float32) for n in spec.kv_inputs}}
    got, want = session.run(feeds), ort.target.run(feeds)
    for name in ("logits", "target_hidden"):
        np.testing.assert_allclose(got[name], want[name], atol=1e-4, rtol=1e-4)
    assert isinstance(got["present.0.key"], mx.array)  # the cache stays in MLX
    assert isinstance(got["greedy_ids"], np.ndarray) and got["greedy_ids"].dtype == np.int64


def test_buffer_form_keeps_kv_in_place_and_matches_the_export(exported, decoders, mlx_lowered):
    """The fused target keeps its K/V buffers: a prefill, then a decode step after rolling back one token, equal
    to the export's concat-form calls on ORT."""
    directory = mlx_lowered("agree_b8")
    manifest = load_manifest(directory)
    session = MlxSession(directory, manifest, "target")
    assert session.retains_state and not set(manifest.target.kv_inputs) & set(session.input_names)
    ops = {label.split()[0] for *_, label in session.nodes}
    assert {"GroupQueryAttention", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"} <= ops
    config = json.loads((exported("agree_b8").target_dir / "config.json").read_text())
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    assert all(attrs["rope"][0] == theta for _, _, _, attrs, label in session.nodes  # mx.fast.rope(base=theta)
               if label.startswith("GroupQuery") and not label.endswith("(output)"))
    ort, spec = decoders("agree_b8").target, manifest.target

    def buffer_call(ids, start):
        total = start + len(ids)
        return session.run({"input_ids": np.array([ids]), "position_ids": np.arange(start, total)[None],
                            "seqlens_k": np.array([total - 1], np.int32),
                            "total_sequence_length": np.array(total, np.int32)}, ["logits"])["logits"]

    prompt = [5, 9, 11, 3, 7]
    empty = {n: np.zeros((1, 0, spec.num_kv_heads, spec.head_dim), np.float32) for n in spec.kv_inputs}
    want = ort.run({"input_ids": np.array([prompt]), "position_ids": np.arange(5)[None], **empty})
    np.testing.assert_allclose(buffer_call(prompt, 0), want["logits"], atol=1e-4, rtol=1e-4)
    past = {n: want[o][:, :4] for n, o in zip(spec.kv_inputs, spec.kv_outputs)}  # roll back the last token
    step = ort.run({"input_ids": np.array([[42]]), "position_ids": np.array([[4]]), **past})
    np.testing.assert_allclose(buffer_call([42], 4), step["logits"], atol=1e-4, rtol=1e-4)
    past = {n: step[o] for n, o in zip(spec.kv_inputs, spec.kv_outputs)}  # the same call shape, one position on:
    step = ort.run({"input_ids": np.array([[17]]), "position_ids": np.array([[5]]), **past})  # the compiled
    np.testing.assert_allclose(buffer_call([17], 5), step["logits"], atol=1e-4, rtol=1e-4)  # rotation's trace
    plan = session._plan(("logits",))  # does not fix the position: the rotations run inside the compiled runs
    assert not any(label.endswith(("(rotation)", "(output)")) for *_, label in plan)
    assert sum(label.startswith("GroupQueryAttention") for *_, label in plan) == len(spec.kv_inputs) // 2


def test_the_lowering_check_refuses_a_wrong_graph(exported, mlx_lowered, tmp_path, monkeypatch):
    """A sliding-window target is refused in MLX's buffer form before any work (its GroupQueryAttention applies no
    window yet); the MLX lowering runs its graphs against the export and refuses a wrong op."""
    with pytest.raises(DFlashError, match="sliding-window layers .* --kv-buffer off"):
        lower_mlx(exported("causal_gqa4_b4").out, tmp_path / "sliding", MlxOptions(kv_buffer=True, ctx_len=512),
                  LowerRequest(progress=False))
    assert load_manifest(mlx_lowered("agree_b8")).lowering.max_relative_difference < 1e-5  # before the bad op
    from dflash_onnx.targets.mlx import ops

    monkeypatch.setitem(ops.OPS, ("", "SimplifiedLayerNormalization"),
                        lambda inputs, attrs: [mx.fast.rms_norm(ops.device(inputs[0]), ops.device(inputs[1]), 1e-2)])
    with pytest.raises(DFlashError, match="the MLX lowering changes"):
        lower_mlx(exported("agree_b8").out, tmp_path / "eps", MlxOptions(ctx_len=512), LowerRequest(progress=False))
    assert not (tmp_path / "sliding").exists() and not (tmp_path / "eps").exists()


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_mlx_is_lossless_against_its_own_greedy(bits, exported, mlx_lowered):
    directory = mlx_lowered("agree_b8", bits=bits)
    weights = load_manifest(directory).lowering.report["weights"]
    assert weights["target"]["quantized"] >= 4 * 7 and weights["draft"]["quantized"] >= 7
    stored = mx.load(str(directory / "target.safetensors"))
    embedding = next(k for k in stored if "embed_tokens" in k).split(".qt.")[0]
    assert embedding not in stored and f"{embedding}.qt.w" in stored  # the embedding is stored quantized only
    decoder = open_decoder(directory, backend="mlx")
    measured = load_manifest(directory).lowering.report["batch_invariance"]  # targets/row_invariance.py
    assert set(measured["differences"]) <= {"1", "2", "4", "8"}
    assert decoder.row_multiple == (measured["row_multiple"] if measured["invariant"] else 1)
    taus = []
    for prompt in _prompts(6, exported("agree_b8").spec.vocab_size, seed=3):
        # full blocks: tau measures the draft, not the verify policy (which reads the lowering's cost curve, taken
        # while the other test process shared the cores)
        dflash = decoder.generate(prompt, 32, "dflash", stop_token_ids=[], verify="full")
        assert dflash.tokens == decoder.generate(prompt, 32, "greedy", stop_token_ids=[]).tokens
        taus.append(dflash.tau)
    assert np.mean(taus) > 1.5  # the quantized draft still agrees with the quantized target
    # checked against the export with its weights rounded as stored (targets/mlx/rounded.py): float arithmetic only
    assert load_manifest(directory).lowering.max_relative_difference < 1e-4


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_quantized_matmuls_keep_float_accuracy_on_the_cpu(dtype):
    """mlx[cpu]'s quantized_matmul accumulates bfloat16 inputs in bfloat16 (7.6 % of the output's scale at K = 2048)
    and runs float16 ones ~38x slower: the session's MatMul gives it float32 activations on the CPU."""
    from dflash_onnx.targets.mlx.ops import OPS, QuantizedWeight

    half = getattr(mx, dtype)
    mx.random.seed(0)
    x = mx.random.normal((4, 2048)).astype(half)
    weight, scales, biases = mx.quantize((mx.random.normal((512, 2048)) * 0.05).astype(half), group_size=64, bits=4)
    out = OPS[("", "MatMul")]([x, QuantizedWeight(weight, scales, biases, 64, 4)], {})[0]
    assert out.dtype == half
    dequantized = mx.dequantize(weight, scales, biases, group_size=64, bits=4).astype(mx.float32)
    want = np.array(x.astype(mx.float32) @ dequantized.T)
    got = np.array(out.astype(mx.float32))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2


def test_the_selector_ops_match_onnx_runtime():
    """TopK, GatherElements, Einsum and Pad (DFlash2's candidate selector and convolutions), on the device and on
    the host, against ONNX Runtime running the same one-node graphs."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from dflash_onnx.targets.mlx.ops import OPS

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 40)).astype(np.float32)
    index = rng.integers(0, 40, size=(2, 5, 3)).astype(np.int64)
    a, b = rng.normal(size=(2, 5, 3, 4)).astype(np.float32), rng.normal(size=(2, 5, 4)).astype(np.float32)
    cases = [
        ("TopK", [x, np.array([6], np.int64)], {"axis": -1}, 2),
        ("GatherElements", [x, index], {"axis": 2}, 1),
        ("Einsum", [a, b], {"equation": "bpir,bpr->bpi"}, 1),
        ("Pad", [x, np.array([0, 2, 0, 0, 0, 0], np.int64)], {"mode": "constant"}, 1),
        ("Pad", [x, np.array([1, 3], np.int64), np.array(0.5, np.float32), np.array([1], np.int64)], {}, 1),
    ]
    for op, inputs, attrs, outputs in cases:
        names, results = [f"i{n}" for n in range(len(inputs))], [f"o{n}" for n in range(outputs)]
        node = helper.make_node(op, names, results, **attrs)
        typed = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                 for n, v in zip(names, inputs)]
        kinds = [TensorProto.FLOAT, TensorProto.INT64][:outputs]
        graph = helper.make_graph([node], "g", typed, [helper.make_tensor_value_info(n, kind, None)
                                                       for n, kind in zip(results, kinds)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, dict(zip(names, inputs)))
        decoded = {k: v.encode() if isinstance(v, str) else v for k, v in attrs.items()}
        for world in (lambda v: v, lambda v: mx.array(v) if v.ndim > 1 else v):  # host, then device
            got = OPS[("", op)]([world(v) for v in inputs], decoded)
            for have, expected in zip(got, want):
                np.testing.assert_allclose(np.array(have), expected, rtol=1e-5, atol=1e-6)


def test_new_call_shapes_do_not_copy_the_weights(mlx_lowered):
    """Compiled runs capture the weights as constants: loaded lazily (mx.load), each call shape's trace loaded its
    own copy (+1.5 GB per new verify size at the Qwen3-4B shape); the session loads them once when it opens."""
    import gc

    directory = mlx_lowered("agree_b8", bits=4)
    weights = sum(a.nbytes for a in mx.load(str(directory / "target.safetensors")).values())
    decoder = open_decoder(directory, backend="mlx")
    prompt = list(range(3, 40))
    decoder.generate(prompt, 12, "dflash", stop_token_ids=[], verify="full")  # K/V buffers at their largest here
    gc.collect()
    before = mx.get_active_memory()
    for tokens in (3, 4, 6, 7):  # DFlash steps verifying blocks of new sizes: new traces
        decoder.generate(prompt, tokens, "dflash", stop_token_ids=[], verify="full")
    gc.collect()
    assert mx.get_active_memory() - before < 0.1 * weights


def test_the_quantized_check_tells_rounding_from_float(exported, mlx_lowered, monkeypatch):
    """Held to the float tolerance, an MLX int4 lowering checked against unrounded weights (what a wrong
    quantization looks like to the check) is refused."""
    from dflash_onnx.targets.mlx import lower

    directory, source = mlx_lowered("agree_b8", bits=4), exported("agree_b8").out
    assert lower._check(source, load_manifest(source), directory, load_manifest(directory), 4) < 1e-4
    monkeypatch.setattr(lower, "rounded_initializers", lambda directory, manifest, graph: ({}, []))
    with pytest.raises(DFlashError, match=r"the MLX lowering changes .*\(allowed 0.0001\)"):
        lower._check(source, load_manifest(source), directory, load_manifest(directory), 4)


def test_draft_shares_the_targets_embedding_and_head(mlx_lowered):
    directory = mlx_lowered("agree_b8")
    manifest = load_manifest(directory)
    assert len(manifest.lowering.shared_with_target) == 2  # embedding and lm_head, stored once
    target, draft = MlxSession(directory, manifest, "target"), MlxSession(directory, manifest, "draft")
    for draft_name, target_name in manifest.lowering.shared_with_target.items():
        assert draft.values[draft_name] is target.values[target_name]  # one loaded copy


def test_backend_and_lowering_must_agree(exported, mlx_lowered, tmp_path):
    with pytest.raises(DFlashError, match="--backend mlx"):
        open_decoder(mlx_lowered("agree_b8"), backend="ort")
    with pytest.raises(DFlashError, match="lower OUT --target mlx"):
        open_decoder(exported("agree_b8").out, backend="mlx")
    with pytest.raises(DFlashError, match="mlx sessions take no option intra_op_threads"):
        open_decoder(mlx_lowered("agree_b8"), intra_op_threads=1)
    with pytest.raises(DFlashError, match="already lowered"):
        lower_mlx(mlx_lowered("agree_b8"), tmp_path / "again", request=LowerRequest(progress=False))
    from dflash_onnx.passes.pipeline import apply_pipeline

    with pytest.raises(DFlashError, match=r"already lowered \(for mlx\)"):  # its graphs carry no weights
        apply_pipeline(mlx_lowered("agree_b8"), ["cleanup"], tmp_path / "passes", progress=False)
    with pytest.raises(DFlashError, match="MLX supports 32, 64 or 128"):
        lower_mlx(exported("agree_b8").out, tmp_path / "bad", MlxOptions(4, 48), LowerRequest(progress=False))
    assert not (tmp_path / "again").exists() and not (tmp_path / "bad").exists()


def test_lower_and_generate_commands(exported, tmp_path, capsys):
    from dflash_onnx.cli import main

    out = tmp_path / "mlx"
    assert main(["lower", str(exported("agree_b2").out), "--target", "mlx", "--out", str(out), "--bits", "8",
                 "--group-size", "32", "--quiet"]) == 0
    assert "8-bit" in capsys.readouterr().out
    assert main(["generate", str(out), "--backend", "mlx", "--prompt-ids", "3,4", "--max-new-tokens", "6",
                 "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 6
    # without --backend, every command picks the directory's own backend (the one rule in targets/)
    assert main(["generate", str(out), "--prompt-ids", "3,4", "--max-new-tokens", "6", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 6
    assert main(["steps", str(out), "--repeats", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["backend"] == "mlx"
    assert main(["steps", str(out), "--repeats", "1", "--markdown"]) == 0  # the table as docs/ prints it
    table, _, line = capsys.readouterr().out.strip().partition("\n\n")
    assert table.splitlines()[2].startswith("| `mlx` | ") and len(table.splitlines()) == 3
    assert line.startswith("ms per call at a context of 256 tokens. Measured ") and "dflash-onnx steps" in line
    # a backend's options are refused with another backend's --target, naming whose they are
    assert main(["lower", str(exported("agree_b2").out), "--target", "ort", "--out", str(tmp_path / "o"),
                 "--bits", "4"]) == 2
    assert "--bits is an option of --target mlx" in capsys.readouterr().err
    assert main(["lower", str(exported("agree_b2").out), "--target", "mlx", "--out", str(tmp_path / "o"),
                 "--threads", "0"]) == 2  # a zero is given as much as any other value
    assert "--threads is an option of --target ort" in capsys.readouterr().err


def test_mlx_lm_peer_decodes_our_tokens(exported, mlx_lowered):
    """`bench --peers mlx-lm`: mlx-lm's native model of the target (same weights, float) greedy-decodes the tokens
    our fused MLX lowering does, and its figures sit beside ours."""
    pytest.importorskip("mlx_lm", reason="mlx-lm (the test extra installs it)")
    from dflash_onnx.bench import BenchOptions, run_bench

    options = BenchOptions(max_new_tokens=12, repeats=1, num_prompts=2, contexts=[16], curve_repeats=1)
    report = run_bench(mlx_lowered("agree_b8"), "mlx", None, options, ["mlx-lm"], (None, None), progress=False)
    (row,) = report["peers"]["rows"]
    assert row["name"].startswith("mlx-lm greedy (float32") and row["identical_to_ours"]
    assert "ours greedy / mlx-lm greedy" in report["peers"]["ratios"]
    # benchmarks/apple_bench.py's table reads this report as a Mac's bench writes it
    apple_bench = benchmark_script("apple_bench")
    rows = apple_bench._row("MLX", json.loads(json.dumps(report)))
    assert rows[0][:2] == ["MLX", "quiet"] and rows[0][-1] == f"{report['aggregate']['tau']:.2f}"
    assert any(row[:2] == ["MLX", "ours greedy / mlx-lm greedy (quiet)"] for row in rows)
    assert len({len(row) for row in rows}) == 1 and len(rows[0]) == len(apple_bench.HEADER)


def test_rope_tables_are_recognised_only_when_exact():
    """cos/sin tables of HF's default RoPE run as mx.fast.rope by base theta; frequencies that no base gives (e.g.
    LLaMA 3's scaled ones) by wavelengths; scaled tables (attention scaling) row by row. Each equals the tables."""
    from dflash_onnx.targets.mlx import ops

    half, rows = 8, 64
    default = 1.0 / 1e6 ** (np.arange(0, 2 * half, 2, dtype=np.float32) / (2 * half))
    llama3 = default * np.linspace(1.0, 0.125, half, dtype=np.float32)
    x = mx.random.normal((1, 2, 5, 2 * half))
    for inv_freq, base in ((default, 1e6), (llama3, None)):
        angles = np.arange(rows, dtype=np.float32)[:, None] * inv_freq
        cos, sin = np.cos(angles), np.sin(angles)
        wavelengths = ops.rope_frequencies(cos, sin)
        assert wavelengths is not None and ops.rope_base(wavelengths) == base
        fast = ops._fast_rope(x, 7, (ops.rope_base(wavelengths), mx.array(wavelengths)))
        table = ops._table_rope(x, 7, mx.array(cos), mx.array(sin))
        np.testing.assert_allclose(np.array(fast), np.array(table), atol=1e-5)
    assert ops.rope_frequencies(0.5 * cos, 0.5 * sin) is None


def test_the_check_is_skipped_with_both_figures_when_the_reference_cannot_fit(exported, tmp_path, monkeypatch, capsys):
    """At a size where ONNX Runtime could not hold the export (float16 held as float32 on CPU), the lowering says
    so with the memory it would need and what is available, and records no difference instead of running out."""
    import dflash_onnx.targets.mlx.lower as mlx_lower

    monkeypatch.setattr(mlx_lower, "available_memory", lambda: 1000)
    manifest = lower_mlx(exported("agree_b8").out, tmp_path / "big", MlxOptions(ctx_len=512), LowerRequest())
    assert manifest.lowering.max_relative_difference is None
    assert "the check against the export is skipped: ONNX Runtime would hold about" in capsys.readouterr().err


def test_the_check_needs_room_for_the_larger_graph_only(exported, tmp_path, monkeypatch):
    """The check opens one graph's session at a time, so memory for the larger graph's reference is enough: with
    room for the target's files but not for both graphs' together, the check still runs."""
    import dflash_onnx.targets.mlx.lower as mlx_lower

    source = exported("agree_b8").out
    sizes = [sum(p.stat().st_size for p in source.glob(f"{graph}.onnx*")) for graph in ("target", "draft")]
    monkeypatch.setattr(mlx_lower, "available_memory", lambda: (max(sizes) + sum(sizes)) / 2 / 0.8)
    manifest = lower_mlx(source, tmp_path / "room", MlxOptions(ctx_len=512), LowerRequest(progress=False))
    assert manifest.lowering.max_relative_difference is not None


def test_a_target_too_slow_to_check_skips_the_check_and_measurements_with_the_figures(exported, tmp_path, monkeypatch,
                                                                                     capsys):
    """Where one decode call shows the check and the measurements would outlast the budget (a 4B target on
    mlx[cpu] takes minutes per call), the lowering says so with the figures instead of running for hours."""
    from dflash_onnx.targets import lowering

    monkeypatch.setattr(lowering, "MEASUREMENT_BUDGET_S", 0.0)
    manifest = lower_mlx(exported("agree_b8").out, tmp_path / "slow", MlxOptions(ctx_len=512),
                         LowerRequest(progress=False))
    err = capsys.readouterr().err
    assert "the check against the export is skipped: one decode call took" in err
    assert "measuring batch invariance and the cost curve is skipped" in err and "calibrate DIR" in err
    assert manifest.lowering.max_relative_difference is None and manifest.costs is None


def test_host_time_demo_fills_both_caches_with_the_same_context(exported, mlx_lowered):
    """benchmarks/mlx_host_time.py --synthetic-context writes the same K/V rows into mlx-lm's cache and our buffers
    instead of prefilling: the next call then gives the same logits on both (rows laid out alike), and logits
    other than a call after a real prefill (so the rows were read, not ignored)."""
    pytest.importorskip("mlx_lm", reason="mlx-lm (the test extra installs it)")
    from mlx_lm.models.cache import make_prompt_cache

    from dflash_onnx.peers import mlx_lm_model

    demo = benchmark_script("mlx_host_time")
    directory = mlx_lowered("agree_b8", kv_buffer=True)
    manifest = load_manifest(directory)
    graph = manifest.target
    session = MlxSession(directory, manifest, "target")
    _, fill_ours = demo._ours(session, graph)
    model = mlx_lm_model(exported("agree_b8").target_dir)
    cache = make_prompt_cache(model)
    context, ids = 40, [5, 6, 7]
    rows = [mx.random.normal((1, graph.num_kv_heads, context, graph.head_dim), key=mx.random.key(i))
            for i in range(len(graph.kv_inputs))]

    def ours() -> np.ndarray:
        end = context + len(ids)
        return session.run({"input_ids": np.array([ids]), "position_ids": np.arange(context, end)[None],
                            "seqlens_k": np.array([end - 1], np.int32),
                            "total_sequence_length": np.array(end, np.int32)}, ["logits"])["logits"]

    def native() -> np.ndarray:
        logits = np.array(model(mx.array([ids]), cache=cache))
        for c in cache:
            c.trim(len(ids))
        return logits

    fill_ours(rows)
    demo._native_fill(cache)(rows)
    filled = ours()
    np.testing.assert_allclose(filled, native(), atol=1e-4)
    for c in cache:
        c.trim(c.offset)
    model(mx.array([list(range(3, 3 + context))]), cache=cache)
    assert np.abs(native() - filled).max() > 1e-2
