"""`--plot DIR`: PNG pictures of a parity report (matplotlib, optional extra `deepinfer[plot]`).

One figure per command: layers -> rel_err and the measured floor per point (log scale) with the first
divergence marked; drift -> both margins and delta margin per position with flips marked; weights ->
rel_err per tensor; kv -> rel_err per layout; next-token -> both top-1 margins per row.
"""
from __future__ import annotations

from pathlib import Path

from deepinfer.parity.report import Report


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'deepinfer[plot]'") from None
    return plt


def write_plots(report: Report, out_dir: str | Path) -> list[Path]:
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    rows = report.rows
    if report.command == "layers":
        x = range(len(rows))
        ax.semilogy(x, [max(r["rel_err"], 1e-20) for r in rows], "o-", label="engine vs reference rel_err")
        ax.semilogy(x, [r["floor"] for r in rows], "s--", label="measured floor")
        ax.set_xticks(list(x), [r["point"] for r in rows], rotation=70, fontsize=7)
        first = report.meta.get("first_divergence")
        if first:
            ax.axvline([r["point"] for r in rows].index(first), color="red", label=f"first divergence: {first}")
    elif report.command == "drift":
        pos = [r["position"] for r in rows]
        ax.plot(pos, [r["ref_margin"] for r in rows], "o-", label="reference margin")
        ax.plot(pos, [r["engine_margin"] for r in rows], "x-", label="engine margin")
        ax.bar(pos, [r["delta_margin"] for r in rows], alpha=0.3, label="delta margin")
        for r in rows:
            if r["flip"]:
                ax.axvline(r["position"], color="red" if r["judgement"] == "defect" else "orange", alpha=0.5)
        ax.set_xlabel("position")
    elif report.command in ("weights", "kv"):
        key = "tensor" if report.command == "weights" else "layout"
        ax.bar(range(len(rows)), [max(r["rel_err"], 1e-20) for r in rows])
        ax.set_yscale("log")
        ax.set_xticks(range(len(rows)), [r[key] for r in rows], rotation=80, fontsize=5 if len(rows) > 40 else 8)
        ax.set_ylabel("rel_err")
    else:  # next-token
        ax.plot([r["ref_margin"] for r in rows if "ref_margin" in r], "o-", label="reference margin")
        ax.plot([r["engine_margin"] for r in rows if "engine_margin" in r], "x-", label="engine margin")
        ax.set_xlabel("row")
    ax.set_title(f"deepinfer parity {report.command}: {report.verdict}"[:120], fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"parity-{report.command}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
