"""`bench --peers llama.cpp`: the precision each side runs, the one-line refusals, and (where llama.cpp is built)
its greedy and draft-dflash decoding of our tiny pair against our tokens."""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import benchmark_script
from spread import varied_prompt_file

from dflash_onnx.bench import BenchOptions, run_bench
from dflash_onnx.llama_cpp import build, gguf, runs
from dflash_onnx.llama_cpp.peer import llama_cpp_rows, threads_of, unsupported_draft
from dflash_onnx.peers import same_tokens
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest


def _llama_cpp() -> build.LlamaCpp | None:
    """A built llama.cpp: DFLASH_ONNX_LLAMA_CPP (a built source tree), else the one bench caches."""
    named = os.environ.get("DFLASH_ONNX_LLAMA_CPP")
    if named:
        return build.find(Path(named))
    return build.built(Path(os.environ.get("DFLASH_ONNX_CACHE") or Path.home() / ".cache" / "dflash-onnx"))


def test_the_gguf_precision_follows_the_directorys(exported):
    """int4 in symmetric blocks -> Q4_0, with zero points -> Q4_1, int8 -> Q8_0, floats stay; the lm_head is
    quantized on both sides or on neither; the note says where block sizes differ."""
    export = load_manifest(exported("agree_b8").out)
    assert gguf.precision_for(export) == gguf.Precision("f32", "f32", "f32", "f32", "F32 throughout, as ours")
    assert gguf.precision_for(replace(export, dtype="float16")).weights == "f16"
    int4 = replace(export, passes=[{"name": "int4", "lossy": True, "options": {"block_size": "32", "lm_head": "true"}}])
    assert (gguf.precision_for(int4).weights, gguf.precision_for(int4).output) == ("q4_0", "q4_0")
    assert "differ" not in gguf.precision_for(int4).note
    int4_64 = replace(export, passes=[{"name": "int4", "lossy": True, "options": {"block_size": 64}}])
    assert gguf.precision_for(int4_64).output == "f32" and "differ in block size" in gguf.precision_for(int4_64).note
    zero_points = replace(export, passes=[{"name": "int4", "options": {"block_size": 32, "symmetric": "false"}}])
    assert gguf.precision_for(zero_points).weights == "q4_1"
    assert gguf.precision_for(replace(export, passes=[{"name": "int8", "options": {}}])).weights == "q8_0"
    assert gguf.precision_for(int4).quantized and not gguf.precision_for(export).quantized
    # a tied target has one GGUF tensor for embedding and head: it takes the head's type, and the note says so
    tied = gguf.precision_for(int4, tied=True)
    assert (tied.embedding, tied.base) == ("q4_0", "f32") and "tied" in tied.note
    assert gguf.precision_for(int4_64, tied=True).embedding == "f32"  # a float head: nothing differs
    mlx = replace(export, lowering=replace(export.lowering or _mlx_lowering(), backend="mlx",
                                           options={"bits": 4, "group_size": 64}))
    assert gguf.precision_for(mlx).weights == "q4_1" and "groups of 64" in gguf.precision_for(mlx).note


def test_a_named_llama_cpp_type_is_quantized_as_llama_cpp_mixes_it(exported, tmp_path, capsys):
    """--llama-cpp-type q4_k_m: llama-quantize picks each tensor's type itself (no --pure, no head or embedding
    type), the note says the formats differ and what ours are; the matching precision keeps every tensor at the
    type matching ours. An unknown type is refused in one line naming the choices, before anything runs."""
    export = load_manifest(exported("agree_b8").out)
    int4 = replace(export, passes=[{"name": "int4", "lossy": True, "options": {"block_size": "32", "lm_head": "true"}}])
    named = gguf.named_precision(int4, "Q4_K_M")
    assert (named.weights, named.output, named.embedding, named.base) == ("q4_k_m", gguf.MIXED, gguf.MIXED, "f32")
    assert named.quantized and "the formats differ" in named.note and "int4 in blocks of 32, lm_head int4" in named.note
    assert "float32 throughout" in gguf.named_precision(export, "q8_0").note
    mlx = replace(export, lowering=replace(export.lowering or _mlx_lowering(), backend="mlx",
                                           options={"bits": 4, "group_size": 64}))
    assert "ours MLX 4-bit affine groups of 64" in gguf.named_precision(mlx, "q4_k_m").note
    with pytest.raises(DFlashError, match=r"--llama-cpp-type q4_k_x: choose one of q4_0, .*q4_k_m"):
        gguf.named_precision(int4, "q4_k_x")
    record = tmp_path / "argv"
    llama = _fake_llama_cpp(tmp_path / "tree", f'for a in "$@"; do echo "$a" >> {record}; '
                                               'case "$a" in *.partial) : > "$a";; esac; done')
    commands = []
    for precision in (named, gguf.precision_for(int4)):
        gguf._quantize(llama, tmp_path / "model-f32.gguf", tmp_path / f"{precision.weights}.gguf", precision)
        commands.append(record.read_text().split())
        record.unlink()
        assert (tmp_path / f"{precision.weights}.gguf").is_file()
    assert commands[0][-1] == "q4_k_m" and "--pure" not in commands[0] and "--output-tensor-type" not in commands[0]
    assert commands[1][:5] == ["--pure", "--output-tensor-type", "q4_0", "--token-embedding-type", "f32"]
    pair = exported("agree_b8")
    serve_load = benchmark_script("serve_load")
    for peers, message in ((["llama.cpp"], "choose one of"), ([], "add --peers llama.cpp")):
        kind = "q9_9" if peers else "q4_k_m"
        with pytest.raises(DFlashError, match=message):
            run_bench(pair.out, None, None, BenchOptions(llama_cpp_type=kind), peers,
                      (pair.target_dir, pair.draft_dir), progress=False)
        with pytest.raises(SystemExit):  # serve_load refuses it the same way, before any server starts
            serve_load.main([str(pair.out), "--llama-cpp-type", kind, *(["--peers", "llama.cpp"] if peers else [])])
        assert message in capsys.readouterr().err


def _mlx_lowering():
    from dflash_onnx.runtime.manifest import Lowering

    return Lowering(backend="mlx", options={})


def test_a_llama_cpp_that_fails_leaves_our_figures_and_says_why(exported, tmp_path):
    """A llama.cpp that cannot be used (here: a tree that is not one) becomes one row saying why; bench keeps
    every figure it measured of ours."""
    from dflash_onnx.peers import _collect

    pair = exported("agree_b8")
    rows = llama_cpp_rows(load_manifest(pair.out), [{"ids": [4, 5, 6], "text": None}], 4, 1, pair.target_dir,
                          pair.draft_dir, tmp_path, False, _collect)
    assert rows == [{"name": "llama.cpp", "unavailable": f"--llama-cpp {tmp_path}: not a llama.cpp source tree (no "
                                                          "convert_hf_to_gguf.py)"}]


def test_tokens_that_end_at_end_of_generation_count_as_ours():
    """llama-server stops at an end-of-generation token where ours (stop ids off) runs on: a prefix ending there is
    ours; a prefix ending anywhere else, or a different token, is not."""
    ours = [[5, 6, 1, 7, 8], [3, 3, 3]]
    assert same_tokens([[5, 6, 1], [3, 3, 3]], ours, [1])
    assert same_tokens([[5, 6], [3, 3, 3]], ours, [1])  # stopped before printing it
    assert not same_tokens([[5, 6], [3, 3, 3]], ours, [2])
    assert not same_tokens([[5, 9, 1], [3, 3, 3]], ours, [1])
    assert not same_tokens([[5, 6, 1], [3, 3]], ours, [1])
    assert same_tokens(ours, ours, None) and not same_tokens([[5, 6, 1], [3, 3, 3]], ours, None)


def test_a_draft_llama_cpp_cannot_run_is_named_before_starting_it(exported):
    pair = exported("agree_b8")
    manifest = load_manifest(pair.out)
    assert unsupported_draft(manifest, pair.target_dir) is None
    last = replace(manifest, target_layer_ids=[1, pair.spec.target_layers - 1])
    assert "taps the target's last layer" in unsupported_draft(last, pair.target_dir)
    assert "dspark" in unsupported_draft(replace(manifest, draft_kind="dspark", draft_layout="speculators"),
                                         pair.target_dir)
    assert unsupported_draft(replace(manifest, draft_kind="dflash2"), pair.target_dir) is None  # converted too
    assert threads_of(manifest) >= 1


def test_a_llama_cpp_that_is_not_there_is_refused_in_one_line(tmp_path):
    with pytest.raises(DFlashError, match="not a llama.cpp source tree"):
        build.find(tmp_path)
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    with pytest.raises(DFlashError, match="llama-bench, llama-server, llama-quantize not found"):
        build.find(tmp_path)
    assert build.built(tmp_path) is None


def _fake_llama_cpp(tree: Path, body: str) -> build.LlamaCpp:
    """A llama.cpp source tree whose every tool is a shell script running `body`."""
    folder = tree / "build" / "bin"
    folder.mkdir(parents=True)
    (tree / "convert_hf_to_gguf.py").write_text("")
    for tool in build.TOOLS:
        script = folder / tool
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return build.find(tree)


def test_a_server_that_dies_is_reported_with_its_own_error(tmp_path):
    """llama-server exiting at start (a GGUF it refuses) ends the peer in one line quoting its error."""
    llama = _fake_llama_cpp(tmp_path, "echo 'loading model'\necho 'error: unknown model architecture: xyz'\nexit 1")
    with pytest.raises(DFlashError, match="llama-server exited .*unknown model architecture"):
        with runs.server(llama, tmp_path / "t.gguf", 1, 64):
            pass
    with pytest.raises(DFlashError, match=r"llama-bench failed \(exit status 1: error: unknown model architecture"):
        runs.bench_greedy_step(llama, tmp_path / "t.gguf", 1, 4, 0, 1, 8)


def test_a_build_that_runs_an_instruction_the_machine_refuses_says_what_to_do(tmp_path):
    """A llama.cpp built with GGML_NATIVE on a machine that advertises AMX but traps it (seen on a virtual machine)
    dies of SIGILL: the peer says so and how to rebuild, instead of quoting its last log line."""
    llama = _fake_llama_cpp(tmp_path, "echo 'llama threadpool init, n_threads = 2'\nkill -ILL $$")
    with pytest.raises(DFlashError, match=r"llama-server exited \(killed by SIGILL: .*-DGGML_NATIVE=OFF"):
        with runs.server(llama, tmp_path / "t.gguf", 1, 64):
            pass
    with pytest.raises(DFlashError, match=r"llama-bench failed \(killed by SIGILL: .*--llama-cpp DIR"):
        runs.bench_greedy_step(llama, tmp_path / "t.gguf", 1, 4, 0, 1, 8)


def test_llama_cpp_decodes_our_tokens_greedy_and_with_our_draft(exported, tmp_path, monkeypatch):
    """llama.cpp's own converter and runs on our pair: greedy and draft-dflash give our tokens, at F32, on prompts
    whose outputs differ (checked first)."""
    llama = _llama_cpp()
    if llama is None:
        pytest.skip("llama.cpp is not built here: `dflash-onnx bench --peers llama.cpp` builds it once (about 20 "
                    "minutes on 2 cores) and caches it, or set DFLASH_ONNX_LLAMA_CPP to a built source tree")
    monkeypatch.setenv("DFLASH_ONNX_CACHE", str(tmp_path))  # the GGUF files of this run only
    pair = exported("varied_b4")
    varied_prompt_file(tmp_path / "prompts.jsonl", pair.decoder())
    target = tmp_path / "target"  # as checkpoints ship: with tokenizer_config.json (transformers otherwise takes
    shutil.copytree(pair.target_dir, target)  # the Qwen2 tokenizer's defaults and adds <|endoftext|>)
    (target / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>"}))
    options = BenchOptions(max_new_tokens=16, repeats=1, contexts=[16], curve_repeats=1, llama_cpp=llama.source)
    report = run_bench(pair.out, None, tmp_path / "prompts.jsonl", options, ["llama.cpp"], (target, pair.draft_dir),
                       progress=False)
    rows = report["peers"]["rows"]
    assert rows[0]["name"].startswith("llama.cpp llama-bench tg16 @ depth ")
    assert rows[0]["verify_ratio"] > 0 and rows[0]["verify_rows"] == 4  # its batch of a block against one token
    assert [r["name"].split(" (")[0] for r in rows[1:]] == ["llama.cpp greedy", "llama.cpp draft-dflash, 3 proposals"]
    assert all(r["tokens_per_second"] > 0 for r in rows)
    assert rows[1]["identical_to_ours"] and rows[2]["identical_to_ours"]
    assert rows[2]["tau"] >= 1  # a pair accepted in part: tau near 1 (tests/spread.py)
    assert {"ours greedy / llama.cpp greedy", "ours dflash / llama.cpp dflash",
            "ours greedy / llama-bench tg"} <= set(report["peers"]["ratios"])
    assert len(list((tmp_path / "llama.cpp" / "gguf").glob("*.gguf"))) == 2  # converted once, F32: not quantized


def test_the_build_leaves_amx_out_where_the_cpu_advertises_it():
    """A native build everywhere but where the CPU advertises AMX: there every instruction set it has is named, AMX
    left out (a VM that advertises AMX but traps it killed every Q4_0 run of a native build)."""
    assert build.instruction_options({"avx", "avx2", "fma"}) == ["-DGGML_NATIVE=ON"]
    options = build.instruction_options({"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "amx_tile",
                                         "amx_int8"})
    assert options[0] == "-DGGML_NATIVE=OFF" and not any("AMX" in option for option in options)
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF",
            "-DGGML_F16C=ON"} <= set(options)


def test_the_converters_refusal_names_the_statement_that_raised():
    """A bare AssertionError from inside llama.cpp's converter is reported with where it came from."""
    traceback = ('Traceback (most recent call last):\n  File "conversion/base.py", line 1588, in get_vocab_base\n'
                 '    assert max(tokenizer.vocab.values()) < vocab_size\nAssertionError\n')
    assert build.failure_line(traceback) == ("AssertionError in get_vocab_base: assert max(tokenizer.vocab.values()) "
                                       "< vocab_size")
    assert build.failure_line("loading\nerror: unknown type\nbye") == "error: unknown type"
