"""Export the playground's current view: the plots as a PNG (matplotlib, the same series as the page),
the per-step series of every run on them as one CSV, and the readouts table as another CSV.

Every number comes from the stored runs the page shows (:attr:`Playground.shown`, its baseline,
the pinned runs and, when a spread is shown, its per-readout statistics).
"""
from __future__ import annotations

import csv
import time
from pathlib import Path

from kvlab.playground.controller import READOUTS

TEACHER, STUDENT, BASE, REFRESH = "#1b9e77", "#d95f02", "#9e9e9e", "#e7298a"
PIN_COLORS = ("#1f77b4", "#9467bd", "#8c564b", "#17becf")


def _runs(pg) -> list[tuple[str, str, dict]]:
    """(role, label, stored result) of every run on the plots: this run, its baseline, the pins."""
    sh = pg.shown
    out = [("run", sh.label, sh.result), ("baseline", "baseline (no refresh, full cache)", sh.base)]
    out += [(f"pin {i + 1}", p.label, p.result) for i, p in enumerate(q for q in pg.pinned if q.key != sh.key)]
    return out


def series_rows(pg) -> list[dict]:
    """One row per (run, step): role, label, run key, step, token, entropy, cache length, source,
    refreshed, evicted."""
    sh = pg.shown
    keys = {"run": sh.key, "baseline": sh.base_key}
    keys.update({f"pin {i + 1}": p.key for i, p in enumerate(q for q in pg.pinned if q.key != sh.key)})
    rows = []
    for role, label, res in _runs(pg):
        st = res["steps"]
        for i in range(len(st["entropy_bits"])):
            rows.append({"role": role, "label": label, "key": keys[role], "step": i + 1, "token_id": st["token_id"][i],
                         "entropy_bits": st["entropy_bits"][i], "cache_len": st["cache_len"][i], "source": st["source"][i],
                         "refreshed": bool(st["refreshed"][i]), "evicted": st["evicted"][i]})
    return rows


def readout_rows(pg) -> list[dict]:
    """One row per readout: this run, baseline, each pin, and (with a spread) mean, baseline mean,
    Δ mean and its paired 95 % CI with the number of pairs."""
    sh = pg.shown
    pins = [p for p in pg.pinned if p.key != sh.key]
    sp = pg.spread
    rows = []
    for name, label, _ in (*READOUTS, ("tps", "decode tok/s (this run's own timing)", "")):
        r = {"readout": name, "label": label, "run": sh.readouts[name], "baseline": sh.base_readouts[name]}
        for i, p in enumerate(pins):
            r[f"pin {i + 1}"] = p.readouts[name]
        if sp is not None and name in sp.stats:
            st = sp.stats[name]
            r.update({"spread_pairs": st["n"], "spread_mean": st["mean"], "spread_base_mean": st["base"],
                      "spread_d": st["d"], "spread_d_lo": st["lo"], "spread_d_hi": st["hi"]})
        rows.append(r)
    return rows


def _write_csv(path: Path, rows: list[dict]) -> None:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def plot_png(pg, path: Path) -> None:
    """The page's three plots (entropy with refreshes and τ, cache length from 0, provenance strip
    with the prompt's end marked) for this run, its baseline and the pins."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sh = pg.shown
    runs = _runs(pg)
    fig, ax = plt.subplots(3, 1, figsize=(9, 8), gridspec_kw={"height_ratios": [0.45, 0.3, 0.25]})
    styles = {"run": dict(color="#444", lw=1.4), "baseline": dict(color=BASE, ls=":", lw=1.2)}
    for i, (role, label, res) in enumerate(runs):
        st = res["steps"]
        x = range(1, len(st["entropy_bits"]) + 1)
        sty = styles.get(role, dict(color=PIN_COLORS[(i - 2) % len(PIN_COLORS)], lw=1.1))
        name = label if role == "run" else (role if role == "baseline" else f"{role}: {label}")
        ax[0].plot(x, st["entropy_bits"], label=name[:70], **sty)
        ax[1].plot(x, st["cache_len"], **sty)
    st = sh.result["steps"]
    ref = [i + 1 for i, f in enumerate(st["refreshed"]) if f]
    if ref:
        ax[0].scatter(ref, [st["entropy_bits"][t - 1] for t in ref], marker="^", color=REFRESH, zorder=3, label="refresh")
    s = sh.settings
    if s.policy == "entropy":
        ax[0].axhline(s.tau_bits, color=STUDENT, ls="--", lw=1.0, label=f"τ = {s.tau_bits:g} bits")
    ax[0].set_title("entropy of the step's distribution (bits)", fontsize=10)
    ax[0].set_xlabel("step t")
    ax[0].legend(fontsize=7, loc="upper right")
    ax[1].set_title("cache length (entries; axis from 0)", fontsize=10)
    ax[1].set_ylim(bottom=0)
    ax[1].set_xlabel("step t")
    live = sh.result.get("live") or {"positions": [], "writers": []}
    colors = [TEACHER if w == "teacher" else STUDENT for w in live["writers"]]
    ax[2].bar(live["positions"], [1] * len(colors), width=1.0, color=colors, linewidth=0)
    ax[2].axvline(sh.prompt_len - 0.5, color="#000", lw=2)
    ax[2].text(sh.prompt_len - 0.5, 1.05, " prompt ends ▸ generated", fontsize=8, va="bottom")
    ax[2].set_ylim(0, 1.3)
    ax[2].set_yticks([])
    ax[2].set_title("provenance of the live cache (who wrote each entry)", fontsize=10)
    ax[2].set_xlabel("cache position")
    ax[2].legend(handles=[Patch(color=TEACHER, label="teacher-written"), Patch(color=STUDENT, label="student-written")],
                 fontsize=7, loc="upper right", ncol=2)
    ro = sh.readouts
    fig.suptitle(f"{sh.label}\nteacher-PPL {ro['teacher_ppl']:.3g} (baseline {sh.base_readouts['teacher_ppl']:.3g}) · "
                 f"KL {ro['kl']:.3g} · refreshes {ro['refreshes']} · one run (1 prompt × 1 seed)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def export_view(pg, out_dir=None) -> list[Path]:
    """Write ``<stem>.png``, ``<stem>-series.csv`` and ``<stem>-readouts.csv`` of the current view to
    ``out_dir`` (default ``./playground-exports``); returns the three paths."""
    if pg.shown is None:
        raise ValueError("nothing is shown yet: wait for a run before exporting")
    out = Path(out_dir) if out_dir is not None else Path.cwd() / "playground-exports"
    out.mkdir(parents=True, exist_ok=True)
    stem = f"playground-{time.strftime('%Y%m%d-%H%M%S')}-{pg.shown.key[:8]}"
    png, series, table = out / f"{stem}.png", out / f"{stem}-series.csv", out / f"{stem}-readouts.csv"
    plot_png(pg, png)
    _write_csv(series, series_rows(pg))
    _write_csv(table, readout_rows(pg))
    return [png, series, table]
