"""How measured figures are printed for the docs: a Markdown table and the line naming command, date and machine."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

from dflash_onnx.figures import command_line, markdown_table, provenance


def test_a_table_has_a_header_a_rule_and_a_row_per_entry():
    assert markdown_table(["stage", "wall"], [["export", "2:11"], ["lower", 95]]).splitlines() == [
        "| stage | wall |", "|---|---|", "| export | 2:11 |", "| lower | 95 |"]


def test_the_command_is_written_as_a_user_types_it(tmp_path, monkeypatch):
    installed = str(Path(sys.prefix) / "bin" / "dflash-onnx")
    assert command_line([installed, "bench", "my dir"]) == "dflash-onnx bench 'my dir'"
    assert command_line(["/x/dflash_onnx/cli.py", "steps", "a"]) == "dflash-onnx steps a"
    script = tmp_path / "benchmarks" / "seed_size.py"
    script.parent.mkdir()
    script.touch()
    monkeypatch.chdir(tmp_path)
    assert command_line([str(script), "--work", "w"]) == "python benchmarks/seed_size.py --work w"


def test_the_provenance_line_names_date_machine_and_command():
    line = provenance(["benchmarks/load_knobs.py", "ORT_DIR"], libraries=("numpy", "no-such-library"))
    assert line.startswith(f"Measured {datetime.date.today().isoformat()} on ")
    assert "cores" in line and "numpy " in line and "no-such-library" not in line
    assert line.endswith("`python benchmarks/load_knobs.py ORT_DIR`.")
