"""The grid's plots: TFLOP/s against S per dtype and head dim (bench_<dtype>_d<D>.png)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.grid import HIDDEN, IMPLS, LABELS, MODES, OURS
from benchmarks.report import group_entries, s_label, split_dense
from benchmarks.targets import cell_value


def make_plots(data: dict, out_dir: Path) -> list[Path]:
    """bench_<dtype>_d<D>.png: TFLOP/s against S, one line per implementation; subplots
    forward / forward+backward x non-causal / causal. Returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - plotting is optional
        data["meta"].setdefault("notes", []).append(f"no plot: matplotlib unavailable ({type(e).__name__})")
        return []
    impls = data["meta"].get("impls", list(IMPLS))
    written = []
    for (dtype, D), es in group_entries(data["rows"]).items():
        dense, _ = split_dense(es)
        if not dense:
            continue
        fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
        for ci, causal in enumerate((False, True)):
            for mi, mode in enumerate(MODES):
                ax = axes[ci][mi]
                for impl in impls:
                    pts = [
                        (e["row"]["S"], cell_value(e["results"].get(impl), mode))
                        for e in dense
                        if e["row"]["causal"] == causal
                    ]
                    pts = [(s, v) for s, v in pts if v is not None]
                    if pts:
                        style = "-" if impl in OURS else "--"
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=LABELS[impl])
                ax.set_xscale("log", base=2)
                xs = sorted({e["row"]["S"] for e in dense})
                ax.set_xticks(xs, [s_label(x) for x in xs])
                ax.minorticks_off()
                ax.set_title(f"{mode}, {'causal' if causal else 'non-causal'}")
                ax.set_ylabel("TFLOP/s")
                ax.set_ylim(bottom=0)
                ax.grid(True, alpha=0.3)
                if ci == 1:
                    ax.set_xlabel("sequence length S (B*S = 16k tokens)")
        handles, labels = [], []
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        if not handles:  # every measurement of this group skipped or failed
            plt.close(fig)
            continue
        fig.legend(handles, labels, loc="lower center", ncol=len(labels))
        fig.suptitle(f"{dtype}, head dim {D}, hidden {HIDDEN} - {data['meta'].get('gpu', '')}")
        fig.tight_layout(rect=(0, 0.05, 1, 0.97))
        path = out_dir / f"bench_{dtype}_d{D}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
