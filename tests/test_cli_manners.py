"""The command line's manners, as a newcomer meets them: --version, the bare command, one-line usage errors, every
default in --help, honest figures for short runs, optimize's sizes read from the files it wrote, the presets'
sizes and chat template, where the demo says DFlash pays."""

from __future__ import annotations

import argparse

import pytest

from dflash_onnx.artifacts.graph_files import graph_bytes
from dflash_onnx.cli import _has_default, build_parser, main
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.runtime.results import GenerationResult, run_summary


def test_version_names_the_package_and_runtime(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    printed = capsys.readouterr().out.strip()
    assert exit_info.value.code == 0 and printed.startswith("dflash-onnx 0.") and "onnxruntime 1." in printed


def test_the_bare_command_lists_every_command(capsys):
    assert main([]) == 0
    printed = capsys.readouterr().out
    commands = build_parser()._subparsers._group_actions[0].choices
    assert all(f"    {name}" in printed for name in commands) and "--version" in printed


@pytest.mark.parametrize("argv, expected", [
    (["lower", "x", "--target", "foo", "--out", "y"], "invalid choice: 'foo'"),
    (["generate", "x", "--prompt-ids", "1", "--mode", "fast"], "invalid choice: 'fast'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["generate", "x"], "one of the arguments --prompt --prompt-ids is required"),
])
def test_a_usage_error_is_one_line_naming_where_help_is(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert expected in lines[0] and lines[0].endswith("--help')")


def test_every_default_is_shown_in_help():
    parser = build_parser()
    for name, command in parser._subparsers._group_actions[0].choices.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if action.option_strings and _has_default(action.default) and \
                    not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                assert "default" in formatter._get_help_string(action).lower(), (name, action.option_strings)
    help_text = parser._subparsers._group_actions[0].choices["generate"].format_help()
    assert "(default: 64)" in help_text and "(default: dflash)" in help_text and "(default: 0)" in help_text


def test_a_short_run_reports_no_rate_it_could_not_measure():
    one = GenerationResult(tokens=[5], ttft_s=0.01, decode_s=1e-7)
    assert run_summary(one, "dflash") == ("1 token, tau - (no DFlash step ran), tok/s - (too few tokens to time "
                                          "decoding), ttft 10.0 ms")
    run = GenerationResult(tokens=[5, 6, 7], acceptance_lengths=[2], ttft_s=0.01, decode_s=0.5)
    assert run_summary(run, "dflash") == "3 tokens, tau 2.00, 6.0 tok/s, ttft 10.0 ms"
    assert "tau" not in run_summary(run, "greedy")


def test_generate_says_once_how_the_prompt_was_sent(exported, tmp_path, capsys):
    out = exported("agree_b2").out
    assert main(["generate", str(out), "--prompt", "hi", "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert err.count("(prompt sent as raw text: the directory has no chat template)") == 1
    assert main(["generate", str(out), "--prompt", "hi", "--max-new-tokens", "3", "--raw"]) == 0
    err = capsys.readouterr().err
    assert "(prompt sent as raw text (--raw))" in err
    # an export records no cost curve: auto's full blocks are said once, with the command that measures a curve
    assert err.count("no cost curve recorded") == 1 and f"'dflash-onnx calibrate {out}'" in err
    assert main(["generate", str(out), "--prompt", "hi", "--max-new-tokens", "3", "--verify", "full"]) == 0
    assert "no cost curve" not in capsys.readouterr().err  # full asked for: nothing to say


def test_optimize_prints_its_sizes_once_from_the_files_it_wrote(exported, tmp_path, capsys):
    source, out = exported("agree_b2").out, tmp_path / "int8"
    assert main(["optimize", str(source), "--passes", "cleanup,int8", "--pass-option", "block_size=16",
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    rows = {line.split()[0]: line.split() for line in captured.out.splitlines() if line.startswith(("target", "draft"))}
    manifest, export = load_manifest(out), load_manifest(source)
    for graph in ("target", "draft"):
        before, after = (graph_bytes(d, getattr(m, graph).file) / 2**20 for d, m in ((source, export), (out, manifest)))
        assert rows[graph][-3:] == [f"{before:.2f}", "->", f"{after:.2f}"], rows[graph]
    assert "MiB" not in captured.err and "[1/4] cleanup on the target" in captured.err  # progress, not the table


def test_the_small_preset_builds_with_a_chat_template_and_the_help_lists_sizes(tmp_path, capsys):
    from dflash_onnx.exporter.tiny import main as tiny_main
    from dflash_onnx.runtime.chat import load_chat_template

    with pytest.raises(SystemExit):
        tiny_main(["--help"])
    listed = capsys.readouterr().out
    assert "tiny-agree" in listed and "qwen3-4b-shaped" in listed and "4022.47M" in listed
    tiny_main(["--preset", "tiny-agree", "--out", str(tmp_path / "pair")])
    captured = capsys.readouterr()
    assert "[1/2] target" in captured.err and "[2/2] draft" in captured.err
    assert load_chat_template(tmp_path / "pair" / "target") is not None
    assert main(["export", "--target", str(tmp_path / "pair" / "target"), "--draft", str(tmp_path / "pair" / "draft"),
                 "--out", str(tmp_path / "export"), "--quiet"]) == 0
    assert load_chat_template(tmp_path / "export") is not None  # the export carries it: serve answers chat


def test_the_demo_pair_ships_a_chat_template():
    from dflash_onnx.demo import PAIR_DIR
    from dflash_onnx.runtime.chat import load_chat_template

    template = load_chat_template(PAIR_DIR / "target")
    assert template is not None and "user" in template.render("hi")


def test_where_dflash_pays_follows_the_measured_costs():
    from dflash_onnx.demo import where_dflash_pays
    from dflash_onnx.runtime.costs import CostModel

    costs = CostModel(verify_ms=[1.0, 1.1, 1.2, 2.0], draft_ms=0.5, context=256, source="test")
    assert "full blocks pay from tau 2.5" in where_dflash_pays(costs, 4, 3.0) and "DFlash pays on" in \
        where_dflash_pays(costs, 4, 3.0)
    assert "full blocks lose here" in where_dflash_pays(costs, 4, 2.0)
    assert "no cost curve" in where_dflash_pays(None, 4, 2.0)
