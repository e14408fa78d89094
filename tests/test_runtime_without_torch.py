"""The runtime needs no torch: `generate`, `bench` (without the torch peers) and `steps` run on an export and
on its ORT lowering in a process where `import torch` and `import transformers` fail (a deployment box
without them); what does need them says so in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash_onnx.runtime.tokenizer import TextCodec

# Runs the CLI with torch and transformers unimportable: a meta-path finder refuses them before any import.
RUNNER = """
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, Blocked())
from dflash_onnx.cli import main
code = main(sys.argv[1:])
assert not {"torch", "transformers"} & set(sys.modules), "torch or transformers got imported"
sys.exit(code)
"""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUNNER, *args], capture_output=True, text=True, timeout=300)


def test_the_blocker_blocks():
    done = subprocess.run([sys.executable, "-c", RUNNER.split("from dflash_onnx")[0] + "import torch"],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "blocked by the test" in done.stderr


@pytest.fixture(scope="module")
def directories(exported, ort_lowered):
    return {"export": exported("agree_b8").out, "ort": ort_lowered("agree_b8")}


@pytest.mark.parametrize("kind", ["export", "ort"])
def test_generate_with_a_text_prompt(kind, directories, decoders):
    done = _cli("generate", str(directories[kind]), "--prompt", "def f(x):", "--max-new-tokens", "12", "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert isinstance(payload["text"], str) and payload["prompt_tokens"] == len("def f(x):")
    prompt = TextCodec(directories["export"]).encode("def f(x):")
    assert payload["tokens"] == decoders("agree_b8").generate(prompt, 12, "greedy").tokens  # lossless without torch


@pytest.mark.parametrize("kind", ["export", "ort"])
def test_bench_and_steps(kind, directories, tmp_path):
    report = tmp_path / "bench.json"
    done = _cli("bench", str(directories[kind]), "--num-prompts", "1", "--max-new-tokens", "8", "--repeats", "1",
                "--contexts", "16", "--curve-repeats", "1", "--quiet", "--json", str(report))
    assert done.returncode == 0, done.stderr
    assert json.loads(report.read_text())["aggregate"]["all_identical_to_greedy"]
    done = _cli("steps", str(directories[kind]), "--context", "16", "--repeats", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["decode_ms"] > 0


def test_what_needs_torch_says_so_in_one_line(directories, exported, tmp_path):
    done = _cli("bench", str(directories["export"]), "--num-prompts", "1", "--max-new-tokens", "4", "--repeats", "1",
                "--contexts", "16", "--curve-repeats", "1", "--quiet", "--peers", "hf")
    assert done.returncode == 2 and "peers hf run PyTorch" in done.stderr and "pip install torch==2.13.0" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    pair = exported("agree_b8")
    done = _cli("export", "--target", str(pair.target_dir), "--draft", str(pair.draft_dir), "--out",
                str(tmp_path / "out"))
    assert done.returncode == 2 and "needs PyTorch and transformers" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    # what needs no torch is checked first: a directory that is not a checkpoint is named as such
    done = _cli("export", "--target", str(tmp_path), "--draft", str(tmp_path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "has no config.json" in done.stderr
