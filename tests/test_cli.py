"""The console command: JSON output, streaming, parity exit codes, one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from dflash_onnx.cli import main


@pytest.fixture
def ids_only_out(exported, tmp_path):
    """A copy of the agree_b8 export without its tokenizer.json (a copy: symlinks leading out of the directory,
    or hard links to external data, are refused as an artifact's files)."""
    out = tmp_path / "ids_only"
    shutil.copytree(exported("agree_b8").out, out, ignore=shutil.ignore_patterns("tokenizer.json"))
    return out


def test_generate_json_has_the_promised_fields(exported, capsys):
    pair = exported("agree_b8")
    for mode in ("dflash", "greedy"):
        assert main(["generate", str(pair.out), "--prompt-ids", "3,4,5", "--max-new-tokens", "12",
                     "--mode", mode, "--json"]) == 0
        payload = json.loads(capsys.readouterr().out)
        for key in ("tokens", "acceptance_lengths", "tau", "tokens_per_second", "ttft_s"):
            assert key in payload
        assert len(payload["tokens"]) == 12 or payload["stopped"]
        assert sum(payload["acceptance_lengths"]) == len(payload["tokens"]) - 1
        if mode == "greedy":
            assert set(payload["acceptance_lengths"]) <= {1}


def test_generate_streams_ids_without_json(ids_only_out, capsys):
    assert main(["generate", str(ids_only_out), "--prompt-ids", "3,4,5", "--max-new-tokens", "6"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split()) == 6 and "tau" in captured.err


def test_sampling_flags(exported, capsys):
    pair = exported("agree_b8")
    args = ["generate", str(pair.out), "--prompt-ids", "3,4", "--max-new-tokens", "8", "--temperature", "0.8",
            "--top-p", "0.9", "--top-k", "20", "--seed", "4", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)["tokens"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == first  # a seed makes sampling repeatable


def test_user_errors_are_one_line_and_exit_2(tmp_path, ids_only_out, capsys):
    assert main(["generate", str(tmp_path), "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not an exported dflash-onnx directory" in err
    assert main(["generate", str(ids_only_out), "--prompt", "hello"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    assert main(["generate", str(ids_only_out), "--prompt-ids", "1,x"]) == 2
    assert main(["export", "--target", str(tmp_path), "--draft", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "has no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--target", "ai100", "--target-cores", "0", "--dry-run"], "--target-cores 0 must be in 1..16"),
    (["--target", "ort", "--ctx-len", "0"], "--ctx-len 0 is below two blocks"),
    (["--target", "ort", "--dry-run"], "--dry-run is an option of --target ai100/coreml, not of --target ort"),
    (["--target", "mlx", "--target-dir", "x"], "--target-dir and --draft-dir are for lowerings that convert"),
    (["--target", "ort", "--passes", "kv-buffer"], "the ORT lowering applies its own rewrites"),
])
def test_lower_flags_are_checked_against_the_backend(flags, message, ids_only_out, tmp_path, capsys):
    assert main(["lower", str(ids_only_out), "--out", str(tmp_path / "o"), "--quiet", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_parity_passes_on_an_exported_pair(exported, capsys):
    pair = exported("causal_gqa4_b4")
    code = main(["parity", str(pair.out), "--target", str(pair.target_dir), "--draft", str(pair.draft_dir),
                 "--prompts", "2", "--max-new-tokens", "12", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"] and report["reference_available"]
    names = {c["name"] for c in report["checks"]}
    assert {"target logits (prefill)", "target logits (verify)", "draft logits (later call)",
            "tokens: dflash-ort == hf greedy", "tokens: dflash-ort == reference"} <= names


def test_parity_fails_on_a_mismatched_graph(exported, tmp_path, capsys):
    """Parity against a different checkpoint must report mismatches and exit 1."""
    from dflash_onnx.exporter.tiny import TinySpec, build_pair

    pair = exported("causal_gqa4_b4")
    other_target, other_draft = build_pair(TinySpec(num_heads=8, num_kv_heads=2, head_dim=8, draft_layers=2,
                                                    block_size=4, is_causal=True, target_layer_ids=[0, 2], seed=99),
                                           tmp_path)
    code = main(["parity", str(pair.out), "--target", str(other_target), "--draft", str(other_draft),
                 "--prompts", "1", "--max-new-tokens", "6"])
    assert code == 1 and "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["export", "generate", "parity", "demo", "bench", "steps", "lower", "optimize",
                                     "distill", "serve"])
def test_help_for_every_command(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0 and "usage: dflash-onnx" in capsys.readouterr().out


def test_optimum_cli_registers_export_dflash(tmp_path):
    pytest.importorskip("optimum.commands", reason="optimum is not installed: pip install -e .[optimum]")
    helped = subprocess.run(["optimum-cli", "export", "dflash", "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "--block-size" in helped.stdout
    failed = subprocess.run(["optimum-cli", "export", "dflash", "--target", str(tmp_path), "--draft", str(tmp_path),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert failed.returncode == 2 and "has no config.json" in failed.stderr


def test_generate_text_prompt_streams_and_reports_text(exported, capsys):
    pair = exported("agree_b8")
    assert main(["generate", str(pair.out), "--prompt", "def f(x):", "--max-new-tokens", "10", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["prompt_tokens"] == len("def f(x):") and isinstance(payload["text"], str)
    assert main(["generate", str(pair.out), "--prompt", "def f(x):", "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == payload["text"]
