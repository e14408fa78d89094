"""The bench's PNG: the verify-cost curve beside the acceptance histogram (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from dflash_onnx.runtime.errors import DFlashError


def plot_report(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DFlashError("--plot needs matplotlib: pip install 'dflash-onnx[bench]' (or matplotlib)") from None
    curve, agg, block = report["curve"], report["aggregate"], report["block_size"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    if "skipped" in curve:
        left.text(0.5, 0.5, curve["skipped"], ha="center", va="center", wrap=True)
        left.set_axis_off()
    else:
        lengths = curve["verify_lengths"]
        for context, times in curve["target_ms"].items():
            line, = left.plot(lengths, times, marker="o", label=f"target, context {context}")
            left.axhline(curve["draft_ms"][context], color=line.get_color(), linestyle="--", linewidth=1,
                         label=f"draft step, context {context}")
            if 1 in lengths:
                one = times[lengths.index(1)]
                left.plot(lengths, [one * t for t in lengths], color=line.get_color(), linestyle=":", linewidth=1,
                          label=f"T x single step, context {context}")
        left.set_xlabel("new tokens per target call (T)")
        left.set_ylabel("median ms per call")
        left.set_ylim(bottom=0, top=1.1 * max(max(t) for t in curve["target_ms"].values()))
        left.set_title("verify cost")
        left.legend(fontsize=7)
    right.bar(range(1, block + 1), agg["acceptance_histogram"])
    right.set_xlabel("tokens committed per verify step")
    right.set_ylabel("steps")
    right.set_title(f"acceptance: tau {agg['tau']:.2f}; DFlash {agg['dflash']['tokens_per_second']:.0f} vs greedy "
                    f"{agg['greedy']['tokens_per_second']:.0f} tok/s ({agg['speedup']:.2f}x)")
    figure.suptitle(f"{Path(report['directory']).name} on {report['backend']}")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
