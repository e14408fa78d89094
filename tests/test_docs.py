"""The README and docs/ stay true to the code: the front page stays a front page, every link and every path,
module and command they name exists, and the README's Python example runs."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a path into the repository, as the pages name files: `dflash_onnx/runtime/decode.py`, `benchmarks/seed_size.py`
REPO_PATH = re.compile(r"`((?:dflash_onnx|passes|targets|benchmarks|tests|docs)/[\w./-]*)`")
MODULE_RUN = re.compile(r"python3? -m ([\w.]+)")


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


def test_the_pages_exist():
    assert {p.name for p in PAGES} >= {"README.md", "architecture.md", "cli.md", "ort.md", "ai100.md", "mlx.md",
                                       "coreml.md", "verify-policy.md", "identical-tokens.md", "security.md",
                                       "large-models.md", "distillation.md", "benchmarks.md", "python-api.md"}


def test_the_readme_is_a_front_page_with_the_set_up_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(line for line in ci.splitlines() if "pytest" in line).strip()
    assert test_command in readme, "the README's test command is the one CI runs"
    assert 'python3 -m pip install -e ".[export]" && dflash-onnx demo' in readme


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        assert linked.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{page.name} links to {target}: no such heading"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_module_named_exists(page):
    text = page.read_text()
    for name in REPO_PATH.findall(text):
        assert (ROOT / name.rstrip("/")).exists() or (page.parent / name).exists(), f"{page.name} names {name}"
    for module in MODULE_RUN.findall(text):
        if module.split(".")[0] in ("dflash_onnx", "passes", "targets"):
            assert importlib.util.find_spec(module) is not None, f"{page.name} runs python -m {module}"


def test_the_readme_python_example_runs(exported):
    readme = (ROOT / "README.md").read_text()
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    directory = re.search(r'open_decoder\("([^"]+)"\)', example).group(1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(example.replace(f'"{directory}"', repr(str(exported("agree_b8").out))), {})
    assert printed.getvalue().count("\n") > 2  # the streamed tokens, the result line and the sampled chunks


def test_the_cli_reference_names_every_flag():
    import argparse

    from dflash_onnx.cli import build_parser

    reference = (ROOT / "docs" / "cli.md").read_text()
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, parser in subcommands.choices.items():
        assert f"## {name}" in reference, f"docs/cli.md has no section for {name}"
        for action in parser._actions:
            missing += [f"{name} {flag}" for flag in action.option_strings
                        if flag.startswith("--") and flag != "--help" and f"`{flag}" not in reference]
    assert not missing, f"docs/cli.md does not explain {missing}"
