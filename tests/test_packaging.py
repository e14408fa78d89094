"""One import name: the wheel installs `dflash_onnx` (and optimum's plugin namespace) and nothing else, every module
of the repository's dflash_onnx/, passes/ and targets/ folders in it; the public API comes from the package's name
and works beside a user's own `runtime.py`, `training/`, `serving.py` and `targets.py`; `python -m dflash_onnx`
runs the CLI."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import dflash_onnx

ROOT = Path(__file__).resolve().parent.parent
# the repository folder each installed package comes from (pyproject.toml's package-dir for the card's two)
SOURCES = {"dflash_onnx": ROOT / "dflash_onnx", "dflash_onnx/passes": ROOT / "passes",
           "dflash_onnx/targets": ROOT / "targets", "optimum/commands/register": ROOT / "optimum/commands/register"}
BARE = {"runtime", "artifacts", "exporter", "training", "serving", "passes", "targets"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> list[str]:
    """The names in a wheel built from a copy of the repository (the checkout stays clean), as pip builds it."""
    work = tmp_path_factory.mktemp("wheel")
    tree = work / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", "tests", "docs", "benchmarks", "build",
                                                              "*.egg-info", "__pycache__", ".pytest_cache"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(work / "dist"), str(tree)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    (path,) = (work / "dist").glob("dflash_onnx-*.whl")
    with zipfile.ZipFile(path) as archive:
        return archive.namelist()


def test_the_wheel_installs_one_import_name(wheel):
    top = {name.split("/")[0] for name in wheel}
    assert top == {"dflash_onnx", "optimum", f"dflash_onnx-{dflash_onnx.__version__}.dist-info"}, top
    assert [n for n in wheel if n.startswith("optimum/")] == ["optimum/commands/register/dflash_onnx.py"]


def test_the_wheel_holds_every_module_and_the_demo_pair(wheel):
    expected = {f"{installed}/{p.relative_to(folder).as_posix()}" for installed, folder in SOURCES.items()
                for p in folder.rglob("*.py") if "__pycache__" not in p.parts}
    assert expected <= set(wheel), sorted(expected - set(wheel))[:10]
    assert "dflash_onnx/passes/quantize.py" in wheel and "dflash_onnx/targets/ort/session.py" in wheel
    assert any(n.startswith("dflash_onnx/demo_pair/target/") for n in wheel)


def test_no_module_is_named_two_ways():
    """The repository's passes/ and targets/ import as dflash_onnx.passes and dflash_onnx.targets only (ruff bans
    the bare names in imports: pyproject.toml's banned-api); a module named in a string (`-m`, a monkeypatch target)
    names the full path likewise."""
    dotted = re.compile(rf"^({'|'.join(BARE)})\.(?!py$)[a-z_]+(\.[a-zA-Z_]+)*$")
    found = []
    for folder in ("dflash_onnx", "passes", "targets", "tests", "benchmarks", "optimum"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and dotted.match(node.value):
                    names = [node.value]
                else:
                    continue
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                          if name.split(".")[0] in BARE]
    assert not found, found


def test_the_public_api_comes_from_the_package_name():
    names = {"open_decoder", "Decoder", "SamplingParams", "GenerationResult", "DFlashError", "Session", "Learnt"}
    assert names <= set(dflash_onnx.__all__) and set(dflash_onnx.__all__) <= set(dir(dflash_onnx))
    for name in dflash_onnx.__all__:
        assert getattr(dflash_onnx, name) is not None, name
    for documented in (dflash_onnx.open_decoder, dflash_onnx.Decoder.__init__, dflash_onnx.Decoder.stream,
                       dflash_onnx.Decoder.generate):
        assert "Args:" in documented.__doc__ or "Returns:" in documented.__doc__, documented
    with pytest.raises(AttributeError, match="no attribute 'runtime_api'"):
        dflash_onnx.runtime_api  # noqa: B018


def test_the_readme_api_runs_beside_a_users_own_modules(exported, tmp_path):
    """A working directory holding runtime.py, training/, serving.py and targets.py of the user's own (each one
    fails if imported) changes nothing: the README's example gives the tokens the decoder gives in this process."""
    pair = exported("agree_b8")
    for name in ("runtime.py", "serving.py", "targets.py", "training/__init__.py", "passes.py", "exporter.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(f"raise SystemExit('the user\\'s {name} was imported')\n")
    script = ("import json, sys\n"
              "from dflash_onnx import open_decoder, SamplingParams, GenerationResult, DFlashError\n"
              "decoder = open_decoder(sys.argv[1])\n"
              "result = decoder.generate([3, 4, 5], max_new_tokens=12, sampling=SamplingParams())\n"
              "assert isinstance(result, GenerationResult)\n"
              "try:\n"
              "    decoder.generate([], 4)\n"
              "except DFlashError as exc:\n"
              "    print(json.dumps({'tokens': result.tokens, 'error': str(exc)}))\n")
    run = subprocess.run([sys.executable, "-c", script, str(pair.out)], cwd=tmp_path, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert out["tokens"] == pair.decoder().generate([3, 4, 5], 12).tokens
    assert "prompt is empty" in out["error"]


def test_python_dash_m_runs_the_cli(tmp_path):
    (tmp_path / "runtime.py").write_text("raise SystemExit('the user\\'s runtime.py was imported')\n")
    run = subprocess.run([sys.executable, "-m", "dflash_onnx", "generate", "--help"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode == 0 and "usage: dflash-onnx generate" in run.stdout, run.stderr


def test_a_decoder_is_configured_when_it_is_made(decoders):
    decoder = decoders("agree_b8")
    with pytest.raises(AttributeError, match="configured when it is made"):
        decoder.guess_padding = False
    plain = decoder.sharing(guess_padding=False)
    assert not plain.guess_padding and decoder.guess_padding and plain.learnt is decoder.learnt
    with pytest.raises(TypeError, match="takes no colour"):
        decoder.sharing(colour="red")
