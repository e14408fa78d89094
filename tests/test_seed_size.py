"""benchmarks/seed_size.py's measurements: a stage's peak memory is its own child's (os.wait4), and a refused stage
leaves its one-line reason in the table instead of a ratio."""

from __future__ import annotations

import sys

from conftest import benchmark_script


def test_a_stage_reports_its_own_peak_and_a_refusal_its_reason(tmp_path):
    seed_size = benchmark_script("seed_size")
    bench = seed_size.Bench(tmp_path)
    out = tmp_path / "out"
    hold = (f"import numpy, pathlib; a = numpy.ones(300 * 2**20 // 8); pathlib.Path({str(out)!r}).mkdir(); "
            f"pathlib.Path({str(out / 'w.bin')!r}).write_bytes(bytes(2**20))")
    big = bench.stage("holds-300MiB", [sys.executable, "-c", hold], out, None, writes=True)
    small = bench.stage("small", [sys.executable, "-c", "print('ok')"], None, out, writes=False)
    refused = bench.stage("refused", [sys.executable, "-c", "import sys; sys.exit('error: needs about 29.75 GiB')"],
                          None, out, writes=False)
    assert big["peak_bytes"] > 300 * 2**20 > small["peak_bytes"]  # each child's own peak, not the largest so far
    assert big["written_bytes"] == 2**20 and big["ratio"] == round(big["peak_bytes"] / 2**20, 2)
    assert small["ratio"] == round(small["peak_bytes"] / 2**20, 2) and small["ratio_of"] == "read"
    assert refused["exit"] == 1 and refused["ratio"] is None
    table = bench.table()
    assert "refused or failed: error: needs about 29.75 GiB" in table and table.count("\n") == 4
