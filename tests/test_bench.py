"""`dflash-onnx bench`: its figures agree with the decoder and the reference package, its math with its inputs."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from spread import varied_prompt_file

from dflash_onnx.bench import (
    BenchOptions,
    ClockedSession,
    aggregate,
    default_verify_lengths,
    first_divergence,
    format_report,
    implied_speedups,
    load_prompts,
    run_bench,
)
from dflash_onnx.cli import main
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets import open_decoder

SMALL = dict(max_new_tokens=24, repeats=1, num_prompts=2, contexts=[16, 64], curve_repeats=2)
VARIED_PAIR = "varied_b4"  # peers' equality runs on a pair whose greedy output depends on the whole prompt


@pytest.fixture(scope="module")
def report(exported):
    return run_bench(exported("agree_b8").out, None, None, BenchOptions(**SMALL), [], (None, None), progress=False)


def test_bench_figures_match_a_plain_decoder_run(exported, report):
    """tau, histogram and tokens are those of Decoder.generate on the same prompts (the oracle)."""
    decoder = exported("agree_b8").decoder()
    assert len(report["prompts"]) == 2
    lengths = []
    for row in report["prompts"]:
        assert isinstance(row["prompt"], str)  # the pair has a tokenizer: held-out code prompts
        dflash = decoder.generate(row["prompt_ids"], 24, "dflash", stop_token_ids=[])
        greedy = decoder.generate(row["prompt_ids"], 24, "greedy", stop_token_ids=[])
        assert row["tokens"] == greedy.tokens
        assert row["identical_to_greedy"] is True
        assert row["dflash"]["acceptance_lengths"] == dflash.acceptance_lengths
        assert row["greedy"]["acceptance_lengths"] == [1] * (len(greedy.tokens) - 1)
        lengths += dflash.acceptance_lengths
    agg = report["aggregate"]
    assert agg["tau"] == pytest.approx(np.mean(lengths))
    assert sum(agg["acceptance_histogram"]) == len(lengths)
    assert agg["acceptance_histogram"] == np.bincount(lengths, minlength=9)[1:].tolist()
    assert agg["all_identical_to_greedy"] is True
    for mode in ("greedy", "dflash"):
        assert 0.0 <= agg[mode]["loop_overhead"] < 1.0
        assert agg[mode]["end_to_end_tokens_per_second"] < agg[mode]["tokens_per_second"]
    assert agg["speedup"] == pytest.approx(agg["dflash"]["tokens_per_second"] / agg["greedy"]["tokens_per_second"])


def test_curve_covers_every_length_and_context(report):
    curve = report["curve"]
    assert curve["verify_lengths"] == [1, 2, 4, 8]
    assert set(curve["target_ms"]) == {"16", "64"} and set(curve["draft_ms"]) == {"16", "64"}
    assert all(len(times) == 4 and min(times) > 0 for times in curve["target_ms"].values())
    tau = report["aggregate"]["tau"]
    for context, implied in report["implied"].items():
        times, draft = curve["target_ms"][context], curve["draft_ms"][context]
        assert implied["implied_speedup"] == pytest.approx(tau * times[0] / (times[-1] + draft))
        assert implied["break_even_tau"] == pytest.approx((times[-1] + draft) / times[0])


def test_aggregate_weights_prompts_by_tokens():
    def row(tokens, greedy_s, dflash_s, lengths, divergence=None):
        mode = lambda s, ls: {"tokens": tokens, "decode_s": s, "ttft_s": 0.01, "backend_s": 0.9 * s,  # noqa: E731
                              "acceptance_lengths": ls,
                              "acceptance_histogram": np.bincount(ls, minlength=5)[1:].tolist()}
        return {"greedy": mode(greedy_s, [1] * tokens), "dflash": mode(dflash_s, lengths), "tokens": [7] * tokens,
                "first_divergence": {"dflash": divergence}, "identical_to_greedy": divergence is None}

    agg = aggregate([row(10, 1.0, 0.5, [4, 4, 1], divergence=5), row(30, 2.0, 1.5, [2, 2])], block=4)
    assert agg["agreement"] == {"dflash": {"prompts": 0.5, "tokens": pytest.approx(35 / 40)}}
    assert not agg["all_identical_to_greedy"]
    assert agg["greedy"]["tokens_per_second"] == pytest.approx(40 / 3.0)
    assert agg["dflash"]["tokens_per_second"] == pytest.approx(40 / 2.0)
    assert agg["speedup"] == pytest.approx(1.5)
    assert agg["tau"] == pytest.approx(13 / 5)
    assert agg["acceptance_histogram"] == [1, 2, 0, 2]
    assert agg["greedy"]["loop_overhead"] == pytest.approx(0.1)


def test_first_divergence_counts_a_length_difference():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_implied_speedup_needs_both_ends_of_the_curve():
    curve = {"verify_lengths": [1, 4], "target_ms": {"256": [1.0, 2.0]}, "draft_ms": {"256": 0.5}}
    assert implied_speedups(curve, 3.0, 4) == {"256": {"implied_speedup": pytest.approx(1.2),
                                                       "break_even_tau": pytest.approx(2.5)}}
    assert implied_speedups(curve, 3.0, 8) == {}
    assert default_verify_lengths(16) == [1, 2, 4, 8, 16] and default_verify_lengths(6) == [1, 2, 4, 6]


def test_clocked_session_adds_up_run_time_and_delegates(exported):
    decoder = exported("agree_b8").decoder()
    clocked = ClockedSession(decoder.target)
    assert clocked.input_names == decoder.target.input_names
    decoder.sharing(target=clocked).generate([5, 6, 7], 8, "greedy")
    assert clocked.seconds > 0


def test_prompt_files(tmp_path):
    ids = tmp_path / "p.jsonl"
    ids.write_text('{"ids": [1, 2, 3]}\n\n{"ids": [4]}\n')
    assert [p["ids"] for p in load_prompts(ids, None, 4, 10)] == [[1, 2, 3], [4]]
    for text, message in (('{"ids": [1, 99]}', "0..9"), ('{"x": 1}', '"prompt"'), ("nope", "not a JSON")):
        ids.write_text(text)
        with pytest.raises(DFlashError, match=message):
            load_prompts(ids, None, 4, 10)
    plain = tmp_path / "p.txt"
    plain.write_text("def f():\n")
    with pytest.raises(DFlashError, match="tokenizer.json"):
        load_prompts(plain, None, 4, 10)
    with pytest.raises(DFlashError, match="no such file"):
        load_prompts(tmp_path / "missing.txt", None, 4, 10)


def test_cli_writes_json_plot_and_runs_the_peers(exported, tmp_path, capsys):
    """The reference package and HF decode the same tokens as ours, on prompts whose outputs differ (checked
    first); the reference's tau is ours."""
    pytest.importorskip("dflash.model", reason="the reference dflash package: pip install --no-deps dflash==0.1.0")
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the test extra installs it)")
    pair = exported(VARIED_PAIR)
    varied_prompt_file(tmp_path / "prompts.jsonl", pair.decoder())
    code = main(["bench", str(pair.out), "--max-new-tokens", "16", "--repeats", "1", "--prompts",
                 str(tmp_path / "prompts.jsonl"), "--contexts", "32", "--curve-repeats", "1", "--block-sizes", "1,4",
                 "--peers", "hf,reference", "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png"),
                 "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "implied" in printed and "ours dflash / reference dflash" in printed
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["curve"]["verify_lengths"] == [1, 4]
    rows = data["peers"]["rows"]
    assert [r["name"].split(" (")[0] for r in rows] == ["hf greedy", "reference dflash_generate block 1",
                                                       "reference dflash_generate block 4"]
    assert all(r["identical_to_ours"] for r in rows)
    assert rows[2]["tau"] == pytest.approx(data["aggregate"]["tau"])
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flags, message", [
    (["--block-sizes", "1,9"], "1..8"), (["--contexts", "a"], "--contexts"), (["--repeats", "0"], "--repeats"),
    (["--load", "-1"], "--load"), (["--peers", "vllm"], "unknown peers"),
])
def test_cli_bad_flags_exit_2(exported, flags, message, capsys):
    code = main(["bench", str(exported("agree_b8").out), "--max-new-tokens", "4", "--repeats", "1", "--num-prompts",
                 "1", "--curve-repeats", "1", "--contexts", "8", "--quiet", *flags])
    assert code == 2
    assert message in capsys.readouterr().err


def test_cost_curve_contexts_past_the_lowering_are_refused_before_any_run(ort_lowered, capsys, monkeypatch):
    """ctx_len 512: a curve at context 600 is refused before the generation runs (not after them); by default
    the contexts that fit are kept."""
    from dflash_onnx import bench
    from dflash_onnx.bench import curve_contexts

    runs = []
    monkeypatch.setattr(bench, "measure_generation", lambda *args, **kwargs: runs.append(args) or [])
    code = main(["bench", str(ort_lowered("agree_b8")), "--max-new-tokens", "4", "--repeats", "1", "--num-prompts",
                 "1", "--curve-repeats", "1", "--contexts", "64,600", "--quiet"])
    assert code == 2 and runs == []
    assert "--contexts 600: a cost-curve call there reads up to 608 positions" in capsys.readouterr().err
    assert curve_contexts(None, 511, 16) == [256] and curve_contexts(None, None, 16) == [256, 1024]
    assert curve_contexts(None, 200, 16) == [184] and curve_contexts([64], 511, 16) == [64]


def test_ort_genai_peer_decodes_our_tokens(exported, tmp_path, monkeypatch):
    """onnxruntime-genai's greedy and n-gram speculative decoding of the same target give our greedy tokens, on
    prompts whose outputs differ (checked first)."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai (the test extra installs it)")
    monkeypatch.setenv("DFLASH_ONNX_CACHE", str(tmp_path))
    pair = exported(VARIED_PAIR)
    varied_prompt_file(tmp_path / "prompts.jsonl", pair.decoder())
    options = BenchOptions(max_new_tokens=16, repeats=1, contexts=[16], curve_repeats=1)
    report = run_bench(pair.out, None, tmp_path / "prompts.jsonl", options, ["ort-genai"], (None, None),
                       progress=False)
    rows = report["peers"]["rows"]
    assert [r["name"].split(" (")[0] for r in rows] == ["ort-genai greedy", "ort-genai n-gram speculative"]
    assert all(r["identical_to_ours"] and r["tokens_per_second"] > 0 for r in rows)
    assert {"ours greedy / ort-genai greedy", "ours dflash / ort-genai speculative"} <= set(report["peers"]["ratios"])
    assert any((tmp_path / "ort-genai").glob("*/genai_config.json"))  # built once, cached


def test_ort_genai_peer_is_built_at_the_directorys_precision_and_provider():
    """int4 against the builder's -p int4, fp16 against fp16, fp32 against fp32; CUDA lowerings on CUDA."""
    from dataclasses import replace

    from fakes import make_manifest

    from dflash_onnx.peers import genai_block_size, genai_build
    from dflash_onnx.runtime.manifest import Lowering

    export = make_manifest()
    assert genai_build(export) == ("fp32", "cpu")
    assert genai_build(replace(export, dtype="float16")) == ("fp16", "cpu")
    int4 = replace(export, passes=[{"name": "cleanup"}, {"name": "int4", "lossy": True}])
    assert genai_build(int4) == ("int4", "cpu")
    assert genai_build(replace(export, passes=[{"name": "int8", "lossy": True}])) == ("int8", "cpu")
    cuda = replace(export, dtype="float16", lowering=Lowering(backend="ort", options={}, provider="cuda"))
    assert genai_build(cuda) == ("fp16", "cuda")
    # the builder quantizes in our blocks: as recorded, else 32 (the default before it was recorded)
    assert genai_block_size(export) is None and genai_block_size(int4) == 32
    recorded = replace(export, passes=[{"name": "int4", "options": {"block_size": "64"}, "lossy": True}])
    assert genai_block_size(recorded) == 64


def test_busy_processes_run_for_the_block_and_are_ended_by_pid():
    import os

    from dflash_onnx.runtime.busy import busy_processes

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    with pytest.raises(RuntimeError), busy_processes(2) as pids:
        assert len(set(pids)) == 2 and all(alive(p) for p in pids)
        raise RuntimeError("the measurement failed")
    assert not any(alive(p) for p in pids)  # ended even when the block raised


def test_bench_load_adds_a_loaded_measurement_beside_the_quiet_one(exported, capsys):
    code = main(["bench", str(exported("agree_b8").out), "--max-new-tokens", "12", "--repeats", "1",
                 "--num-prompts", "1", "--curve-repeats", "1", "--contexts", "8", "--quiet", "--load", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "quiet vs 1 busy process(es)" in out
    rows = [line for line in out.splitlines() if line.startswith(("ours greedy ", "ours dflash "))]
    assert len(rows) == 2 and all(line.rstrip().endswith("%") for line in rows)


def test_bench_load_report_pairs_quiet_and_loaded_figures(exported):
    from dflash_onnx.bench import quiet_and_loaded

    options = BenchOptions(max_new_tokens=12, repeats=1, num_prompts=1, contexts=[8], curve_repeats=1, load=1)
    report = run_bench(exported("agree_b8").out, None, None, options, [], (None, None), progress=False)
    loaded = report["loaded"]
    assert loaded["load"] == 1 and loaded["aggregate"]["all_identical_to_greedy"]
    assert loaded["prompts"][0]["tokens"] == report["prompts"][0]["tokens"]  # the same decode, loaded
    rows = {row["name"]: row for row in quiet_and_loaded(report)}
    assert set(rows) >= {"ours greedy", "ours dflash"}
    greedy = rows["ours greedy"]
    assert greedy["quiet"] == report["aggregate"]["greedy"]["tokens_per_second"]
    assert greedy["loaded"] == loaded["aggregate"]["greedy"]["tokens_per_second"]
    assert greedy["change"] == pytest.approx(greedy["loaded"] / greedy["quiet"] - 1)
    # the same figures as docs/ prints them (bench --markdown)
    from dflash_onnx.bench import markdown_report

    table, _, line = markdown_report(report, ["dflash-onnx", "bench", "DIR", "--markdown"]).partition("\n\n")
    header, _, *body = table.splitlines()
    assert header == "| run | tok/s quiet | tok/s, 1 busy | vs our greedy | tau | our tokens |"
    assert body[0] == f"| ours greedy | {greedy['quiet']:.1f} | {greedy['loaded']:.1f} | 1.00x |  | - |"
    dflash = next(row for row in body if row.startswith("| ours DFlash, verify "))
    assert f"| {report['aggregate']['tau']:.2f} |" in dflash
    assert "DFlash tokens identical to greedy: yes." in line and line.endswith("`dflash-onnx bench DIR --markdown`.")


def test_bench_times_greedy_without_padding_beside_the_batch_invariant_runs(ort_lowered, capsys):
    """On an ORT lowering that pads calls, bench also times the fastest greedy and says how many tokens agree."""
    directory = ort_lowered("agree_b8")
    options = BenchOptions(max_new_tokens=12, repeats=1, num_prompts=2, contexts=[8], curve_repeats=1)
    report = run_bench(directory, None, None, options, [], (None, None), progress=False)
    agg = report["aggregate"]
    assert report["batch_invariant"] and report["row_multiple"] == load_manifest(directory).lowering.row_multiple
    assert ("greedy_unpadded" in agg) == (report["row_multiple"] > 1)
    assert agg["agreement"]["dflash"] == {"prompts": 1.0, "tokens": 1.0} and agg["all_identical_to_greedy"]
    if "greedy_unpadded" in agg:
        assert agg["speedup_vs_unpadded"] == pytest.approx(agg["dflash"]["tokens_per_second"]
                                                           / agg["greedy_unpadded"]["tokens_per_second"])
        assert "greedy without the batch-invariance padding" in format_report(report)
    off = run_bench(directory, None, None, replace(options, batch_invariant=False), [], (None, None), progress=False)
    assert off["row_multiple"] == 1 and "greedy_unpadded" not in off["aggregate"]


def test_ort_genai_sliding_window_cache_keeps_the_context_for_its_rewinds(tmp_path):
    """The builder writes a sliding-window cache_slack of 0, with which genai's runtime refuses the n-gram run's
    rewinds once the cache has slid ("Cannot rewind ... evicted", measured on gpt-oss): the built config keeps the
    context resident; a config without a sliding window is left as it is."""
    import json

    from dflash_onnx.peers import _keep_rewinds_resident

    sliding, dense = tmp_path / "sliding.json", tmp_path / "dense.json"
    window = {"window_size": 128, "cache_slack": 0}
    sliding.write_text(json.dumps({"model": {"context_length": 4096, "decoder": {"sliding_window": window}}}))
    dense.write_text(json.dumps({"model": {"context_length": 4096, "decoder": {}}}))
    before = dense.read_text()
    _keep_rewinds_resident(sliding)
    _keep_rewinds_resident(dense)
    assert json.loads(sliding.read_text())["model"]["decoder"]["sliding_window"]["cache_slack"] == 4096
    assert dense.read_text() == before


def test_bench_measures_at_each_prompt_length(exported, ort_lowered, tmp_path, capsys):
    """--prompt-tokens: prompts of exactly those lengths (held-out code cut to length), per length the time to first
    token, the prefill rate and each mode's decoding there, DFlash's tokens greedy's; the table as docs print it; a
    length the lowering cannot hold is refused before any run, in one line."""
    out = exported("agree_b8").out
    code = main(["bench", str(out), "--prompt-tokens", "24,96", "--num-prompts", "2", "--max-new-tokens", "8",
                 "--repeats", "1", "--contexts", "16", "--curve-repeats", "1", "--markdown", "--json",
                 str(tmp_path / "depth.json"), "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0 and "by prompt length" in printed and "| prompt tokens | ttft ms | prefill tok/s |" in printed
    report = json.loads((tmp_path / "depth.json").read_text())
    assert [d["prompt_tokens"] for d in report["depths"]] == [24, 96]
    for depth in report["depths"]:
        assert [len(p["prompt_ids"]) for p in depth["prompts"]] == [depth["prompt_tokens"]] * 2
        assert depth["prefill_tokens_per_second"] == pytest.approx(depth["prompt_tokens"] / depth["ttft_ms"] * 1000)
        assert depth["aggregate"]["all_identical_to_greedy"] and depth["aggregate"]["dflash"]["tokens_per_second"] > 0
    assert report["depth_figures"]["header"][:4] == ["prompt tokens", "ttft ms", "prefill tok/s", "one-row greedy"]
    with pytest.raises(DFlashError, match="give one"):
        run_bench(out, None, tmp_path / "p.txt", BenchOptions(prompt_tokens=[8]), [], (None, None), progress=False)
    lowered = ort_lowered("agree_b8")
    holds = open_decoder(lowered).capacity
    assert main(["bench", str(lowered), "--prompt-tokens", str(holds), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"--prompt-tokens {holds}" in err and "--ctx-len" in err and len(err.strip().splitlines()) == 1
