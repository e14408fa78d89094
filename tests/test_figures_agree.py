"""One figure, one source (issue 54): a figure the README quotes is the one the docs section it cites prints, a
docs table kept as its command's JSON (docs/figures/) is that JSON rendered, a table of measurements holds no
replayed or simulated row, and every README speed figure says which pair, tau and context it was taken on and
whether it was measured or replayed. No model is built: the pages are read as text, and the kept replays are
recomputed from their shipped recordings (numpy, about a second)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from dflash_onnx.figures import figures_record, markdown_table, read_figures, render

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
FIGURES = sorted((DOCS / "figures").glob("*.json"))

# a ratio (6.2x, 11x) or a decimal figure (57.5 tok/s, tau 15.75, 2.26 GiB); not a version's or a name's digits
FIGURE = re.compile(r"(?<![\w.-])(\d+\.\d+x?|\d+x)(?!\w|\.\d)")
RATIO = re.compile(r"(?<![\w.-])\d+(?:\.\d+)?x(?!\w)")
DOCS_LINK = re.compile(r"\]\((docs/[\w.-]+\.md)(?:#([\w-]+))?\)")
CODE_SPAN = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
REPLAYED = re.compile(r"\b(replay\w*|simulat\w*)", re.IGNORECASE)
MEASURED = re.compile(r"\bmeasured\b", re.IGNORECASE)
# what a README speed figure must name: its pair's tau, layer count and vocabulary, its context, its provenance
NAMES = {"tau": re.compile(r"\btau\b"), "layer count": re.compile(r"\d+[ -]layers?\b"),
         "vocabulary": re.compile(r"\bvocab"),
         "context": re.compile(r"\d+-token (?:prompts?|context)|prompts? of ~?\d+ tokens"),
         "measured or replayed": re.compile(r"\b(?:measured|replayed)\b", re.IGNORECASE)}


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading (before a repeated heading's -1, -2)."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _prose(text: str) -> list[str]:
    """The page's lines with fenced code blanked, so that a shell comment is not read as a heading."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def sections(page: Path) -> dict[str, str]:
    """Each heading's anchor -> the text under it up to the next heading of its level or above (its subsections
    included); "" -> the whole page."""
    lines = _prose(page.read_text())
    headings = [(i, len(line) - len(line.lstrip("#")), line.lstrip("#")) for i, line in enumerate(lines)
                if re.match(r"#{1,6} ", line)]
    found, seen = {"": "\n".join(lines)}, {}
    for n, (start, level, title) in enumerate(headings):
        end = next((i for i, lv, _ in headings[n + 1:] if lv <= level), len(lines))
        slug = _slug(title)
        anchor = slug if slug not in seen else f"{slug}-{seen[slug]}"
        seen[slug] = seen.get(slug, 0) + 1
        found[anchor] = "\n".join(lines[start:end])
    return found


def blocks(page: Path) -> list[str]:
    """A page's table rows, list items and paragraphs (indented code left out), each as one string."""
    found, current = [], []
    for line in [*_prose(page.read_text()), ""]:
        starts = line.startswith(("|", "- ", "#")) or not line.strip()
        if starts and current:
            found.append(" ".join(current))
            current = []
        if line.startswith("|") or line.startswith("#"):
            found.append(line)
        elif line.strip() and not (not current and line.startswith("    ")):
            current.append(line.strip())
    return found


def tables(page: Path) -> list[tuple[str, list[str]]]:
    """Each Markdown table of a page: (its caption: the headings above it and the paragraphs right before and
    after it, its rows below the header)."""
    lines = _prose(page.read_text())
    found, headings, n = [], {}, 0
    while n < len(lines):
        line = lines[n]
        if re.match(r"#{1,6} ", line):
            level = len(line) - len(line.lstrip("#"))
            headings = {lv: title for lv, title in headings.items() if lv < level} | {level: line}
        if not line.startswith("|"):
            n += 1
            continue
        end = next((i for i in range(n, len(lines)) if not lines[i].startswith("|")), len(lines))
        before = _paragraph(lines, n - 1, -1)
        after = _paragraph(lines, end, 1)
        found.append((" ".join([*headings.values(), lines[n], before, after]), lines[n + 2:end]))
        n = end
    return found


def _paragraph(lines: list[str], start: int, step: int) -> str:
    """The paragraph next to a table: from `start`, past blank lines, to the next blank line or heading."""
    while 0 <= start < len(lines) and not lines[start].strip():
        start += step
    text = []
    while 0 <= start < len(lines) and lines[start].strip() and not lines[start].startswith(("#", "|")):
        text.append(lines[start])
        start += step
    return " ".join(text[::step])


def _figures(block: str) -> list[str]:
    return FIGURE.findall(LINK_TARGET.sub("]", CODE_SPAN.sub("", block)))


def _speed_blocks() -> list[str]:
    """The README blocks that quote a ratio or a tok/s figure (code spans and link targets aside)."""
    return [b for b in blocks(README) if not b.startswith("#") and not re.fullmatch(r"[|\s:-]+", b)
            and (RATIO.search(LINK_TARGET.sub("]", CODE_SPAN.sub("", b))) or "tok/s" in b)]


@pytest.mark.parametrize("block", _speed_blocks(), ids=lambda b: b[:60])
def test_a_readme_figure_is_the_one_the_docs_section_it_cites_prints(block):
    """Each figure of a README block is printed in a docs section the block links to (`docs/X.md#anchor`; a link
    to a whole page is a pointer, not a source), so that the front page restates a source rather than a second
    measurement; a figure without a linked section has no source."""
    cited = [(DOCS / Path(page).name, anchor) for page, anchor in DOCS_LINK.findall(block) if anchor]
    assert cited, f"no docs section (docs/X.md#anchor) cited for: {block}"
    text = "\n".join(sections(page).get(anchor, "") for page, anchor in cited)
    plain = CODE_SPAN.sub("", text)
    missing = [f for f in _figures(block)
               if not re.search(rf"(?<![\w.-]){re.escape(f)}(?!\w|\.\d)", plain)]
    assert not missing, f"{missing} not printed in {[f'{p.name}#{a}' for p, a in cited]}, cited by: {block}"


@pytest.mark.parametrize("block", [b for b in _speed_blocks() if re.search(r"tok/s|greedy|DFlash", b)],
                         ids=lambda b: b[:60])
def test_a_readme_speed_figure_names_its_pair_tau_context_and_provenance(block):
    """A speed figure means nothing without the pair (a draft built to agree runs near tau 16, the trained demo
    pair near 5), the model's real size, the context it was taken at, and whether it was measured or replayed."""
    missing = [name for name, pattern in NAMES.items() if not pattern.search(block)]
    assert not missing, f"names no {missing}: {block}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_replayed_row_in_a_table_of_measurements(page):
    for caption, rows in tables(page):
        if MEASURED.search(caption):
            replayed = [row for row in rows if REPLAYED.search(row)]
            assert not replayed, f"{page.name}: a table of measurements holds replayed rows: {replayed}"


def test_every_kept_figures_file_renders_to_the_table_its_page_prints():
    """docs/figures/NAME.json is what a command wrote with --json; the page that cites it prints it rendered."""
    assert FIGURES, "docs/figures/ holds no figures file"
    for path in FIGURES:
        citing = [page for page in PAGES if f"figures/{path.name}" in page.read_text()]
        assert citing, f"no page cites docs/figures/{path.name}"
        table = render(read_figures(path))
        for page in citing:
            assert table in page.read_text(), f"{page.name} does not print docs/figures/{path.name} as rendered"


def test_a_kept_replay_is_what_its_command_computes_now(tmp_path):
    """A replay costs no measurement, so a kept one is recomputed from its shipped recording: the file is the
    command's output, not a table retyped, and a change to the policy that moves it shows here."""
    from conftest import benchmark_script

    replay = benchmark_script("policy_replay")
    for path in FIGURES:
        kept = read_figures(path)
        _, script, *args = shlex.split(kept["command"])
        if script != "benchmarks/policy_replay.py":
            continue
        out = tmp_path / path.name
        at = args.index("--json")
        replay.main([*args[:at], "--json", str(out), *args[at + 2:]])
        now = read_figures(out)
        assert {k: now[k] for k in ("verb", "header", "rows", "caption")} == {
            k: kept[k] for k in ("verb", "header", "rows", "caption")}, f"{path.name} is not what {script} gives now"


def test_a_figures_record_round_trips_through_json_to_the_printed_table(tmp_path):
    record = figures_record(["stage", "wall"], [["export", 2.5]], "One run.", ["dflash-onnx", "bench", "D"],
                            libraries=(), verb="Computed")
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"aggregate": {}, "figures": record}))  # as `bench --json` writes it
    text = render(read_figures(path))
    table, _, line = text.partition("\n\n")
    assert table == markdown_table(["stage", "wall"], [["export", "2.5"]])
    assert line.startswith(f"One run. Computed {record['date']} on ") and line.endswith("`dflash-onnx bench D`.")
    path.write_text(json.dumps({"aggregate": {}}))
    with pytest.raises(ValueError, match="not a figures record"):
        read_figures(path)
