"""Targets the exporter does not build yet are refused in one line naming their architecture and each missing part,
before anything is loaded, traced or written; what transformers raises for an unforeseen one becomes one line too."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from dflash_onnx.cli import main
from dflash_onnx.exporter.architectures import refused_unless_built
from dflash_onnx.exporter.tiny import TinySpec, build_pair
from dflash_onnx.runtime.errors import DFlashError

# model_type -> what the refusal names (transformers' own default configs of each family)
FAMILIES = {
    "mixtral": ["mixture-of-experts layers (8 experts)"],
    "deepseek_v3": ["mixture-of-experts layers", "multi-head latent attention"],
    "kimi_k25": ["does not build as a causal LM"],
}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return build_pair(TinySpec(), tmp_path_factory.mktemp("pair"))[1]


def _target(root, model_type: str):
    """A target directory as a checkpoint ships it: transformers' config of the family and a safetensors file."""
    from transformers import CONFIG_MAPPING

    directory = root / model_type
    CONFIG_MAPPING[model_type]().save_pretrained(str(directory))
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_family_the_exporter_does_not_build_is_refused_in_one_line(model_type, draft_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["export", "--target", str(_target(tmp_path, model_type)), "--draft", str(draft_dir),
                 "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"is a {model_type} model" in err and all(part in err for part in FAMILIES[model_type]), err
    assert not out.exists() and not list(tmp_path.glob(".out.*"))  # nothing written, no staging left


def test_the_refusal_is_what_the_command_line_prints(draft_dir, tmp_path):
    done = subprocess.run([sys.executable, "-m", "dflash_onnx.cli", "export", "--target",
                           str(_target(tmp_path, "deepseek_v3")), "--draft", str(draft_dir), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "multi-head latent attention" in done.stderr


def test_an_unforeseen_failure_inside_transformers_is_one_line():
    with pytest.raises(DFlashError, match=r"target newlm: tracing failed \(RuntimeError: no kernel\): this "
                                          r"architecture is not supported yet"):
        with refused_unless_built("newlm", "tracing"):
            raise RuntimeError("no kernel\nat line 3")
    with pytest.raises(MemoryError), refused_unless_built("newlm", "tracing"):  # the machine's errors pass through
        raise MemoryError


DENSE = ["qwen3", "llama", "qwen2", "mistral", "phi3", "olmo2", "glm4", "gemma3_text", "granite", "gemma4_text",
         "gemma4"]


@pytest.mark.parametrize("model_type", DENSE)
def test_dense_families_pass_the_architecture_check(model_type):
    from transformers import CONFIG_MAPPING

    from dflash_onnx.exporter.architectures import check_architecture, missing_parts

    config = CONFIG_MAPPING[model_type]()
    assert missing_parts(config.get_text_config(decoder=True)) == []
    check_architecture(config, model_type)


@pytest.mark.parametrize("model_type", ["phi3", "gemma3_text"])  # fused q/k/v and gate/up; scaled embeddings
def test_other_dense_families_export_and_decode_exactly(model_type, tmp_path):
    """Besides the Qwen3 / LLaMA pairs of the other tests: the ORT export against the family's own transformers
    class, shape by shape, and DFlash tokens equal to its HF greedy `generate` (parity)."""
    from dflash_onnx.exporter.export import export_pair
    from dflash_onnx.parity import run_parity

    target, draft = build_pair(TinySpec(model_type=model_type, agree=True, tie_embeddings=False), tmp_path)
    export_pair(target, draft, tmp_path / "out", progress=False)
    report = run_parity(tmp_path / "out", num_prompts=2, max_new_tokens=16)
    assert report.ok, [c for c in report.checks if not c.ok]
    assert any(c.name == "tokens: dflash-ort == hf greedy" for c in report.checks)  # token identity was checked
