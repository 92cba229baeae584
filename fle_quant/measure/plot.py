"""The measurement plots, drawn with matplotlib's Agg backend (no display).

* :func:`size_kld` -- file size against mean KLD (with its standard error),
  FLE's files and the public files as separate markers, decode speed as the
  points' colour when every point has one.
* :func:`sensitivity_heatmap` -- the predicted error of every layer (rows)
  and candidate source (columns) of an ``fle.sensitivity/1`` table on a log
  colour scale, with a selection's choice per layer marked.
* :func:`predicted_vs_measured` -- the summed predicted error of several
  built files' selections against their measured mean KLD, with Spearman's
  rank correlation (scipy).
* :func:`hit_rate` -- the engine's expert cache hit rate per decode step
  and its moving mean (``fle-engine generate --stats-json``).
* :func:`comparison` -- an ``fle-compare`` result: mean KLD per text and the
  speed change with its interval, both over file size.
* :func:`forest` -- each candidate's change in decode speed from an
  ``fle-bracket`` result with its 95 % interval, overall and per category,
  with the reference drift in the title.

Each function writes one PNG, returns the sentence that says what it shows
and the figure's axes (for tests).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..errors import FleError
from ..files import OutputSet, write_error

__all__ = ["SizePoint", "size_kld", "sensitivity_heatmap", "forest", "predicted_vs_measured", "hit_rate",
           "rank_correlation", "comparison",
           "file_size"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str, force: bool) -> None:
    """Write the figure through FLE's output mechanism (temporary name, then renamed)."""
    from pathlib import Path

    final = Path(path)
    if final.suffix.lower() != ".png":
        raise FleError(f"{final}: give a .png output name")
    with OutputSet([[final]], force=force) as outs:
        try:
            with outs.open(final, "wb") as f:
                fig.savefig(f, format="png", dpi=120, bbox_inches="tight")
        except OSError as e:
            raise write_error(final, e) from None
        outs.commit()


def file_size(path: str) -> int:
    """Bytes of a GGUF model, every shard of a split model counted."""
    from pathlib import Path

    from ..files import check_input
    from ..gguf_reader import _shard_list

    check_input(path, "GGUF model")
    try:
        return int(sum(os.path.getsize(p) for p in _shard_list(Path(path))))
    except OSError as e:
        raise FleError(f"{path}: cannot read its size ({e.strerror}); give a GGUF model or a size") from None


@dataclass
class SizePoint:
    name: str
    size_bytes: int
    kld: float
    kld_se: float
    public: bool = False
    speed: float | None = None


def size_kld(points: list[SizePoint], out: str, *, force: bool = False, title: str = ""):
    if not points:
        raise FleError("give at least one point (--point or --public)")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    colour = all(p.speed is not None for p in points)
    unit, scale = ("GB", 1e9) if max(p.size_bytes for p in points) >= 1e9 else ("MB", 1e6)
    sizes = np.array([p.size_bytes / scale for p in points])
    klds = np.array([p.kld for p in points])
    ses = np.array([p.kld_se for p in points])
    sc = None
    for public, marker, label in ((False, "o", "FLE files"), (True, "s", "public files")):
        m = np.array([p.public == public for p in points])
        if not m.any():
            continue
        ax.errorbar(sizes[m], klds[m], yerr=ses[m], fmt="none", ecolor="0.5", capsize=2, zorder=1)
        if colour:
            sp = np.array([p.speed for p in points])
            sc = ax.scatter(sizes[m], klds[m], c=sp[m], cmap="viridis", marker=marker, label=label, zorder=2,
                            vmin=sp.min(), vmax=sp.max(), edgecolors="k")
        else:
            ax.scatter(sizes[m], klds[m], marker=marker, label=label, zorder=2, edgecolors="k")
    for p, x, y in zip(points, sizes, klds):
        ax.annotate(p.name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if sc is not None:
        fig.colorbar(sc, ax=ax, label="decode speed (t/s)")
    ax.set_xlabel(f"file size ({unit})")
    ax.set_ylabel("mean KLD vs base")
    ax.set_title(title or "Size vs KL divergence")
    ax.legend()
    ax.grid(True, alpha=0.3)
    _save(fig, out, force)
    plt.close(fig)
    what = (f"{out}: file size ({unit}) against mean KLD with ±1 standard error for {len(points)} files "
            f"(circles FLE's, squares public)" + (", colour = decode speed" if colour else ""))
    return what, ax


def sensitivity_heatmap(table, out: str, selection=None, *, force: bool = False):
    """``table``: :class:`fle_quant.select.SensitivityTable`; ``selection``:
    :class:`fle_quant.select.Selection` or None."""
    plt = _pyplot()
    from matplotlib.colors import LogNorm

    from ..units import format_size

    err = np.where(table.available, table.errors, np.nan)
    pos = err[np.isfinite(err) & (err > 0)]
    floor = pos.min() / 10 if pos.size else 1e-12
    shown = np.where(np.isfinite(err), np.maximum(err, floor), np.nan)
    n_l, n_c = shown.shape
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * n_c, 1.5 + 0.22 * n_l))
    vmax = np.nanmax(shown) if np.isfinite(shown).any() else 1.0
    im = ax.imshow(shown, aspect="auto", cmap="magma_r", norm=LogNorm(vmin=floor, vmax=max(vmax, floor * 10)),
                   interpolation="nearest")
    fig.colorbar(im, ax=ax, label="predicted relative error (log)")
    ax.set_xticks(range(n_c), labels=list(table.names), rotation=45, ha="right")
    ax.set_yticks(range(n_l), labels=[str(x) for x in table.layers])
    ax.set_xlabel("source (base first)")
    ax.set_ylabel("layer")
    marked = 0
    if selection is not None:
        if selection.table_sha256 and table.sha256 and selection.table_sha256 != table.sha256:
            raise FleError("the selection was made from another sensitivity table (table_sha256 differs); "
                           "give the table it was made from")
        col = {n: j for j, n in enumerate(table.names)}
        xs, ys = [], []
        for i, layer in enumerate(table.layers):
            src = selection.sources.get(layer)
            if src is None or src not in col:
                raise FleError(f"the selection names source {src!r} for layer {layer}, which the table lacks")
            xs.append(col[src])
            ys.append(i)
        ax.scatter(xs, ys, marker="s", s=60, facecolors="none", edgecolors="cyan", linewidths=2,
                   label="selection")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
        marked = len(xs)
        ax.set_title(f"Sensitivity per layer; selection: error {selection.predicted_error:.3g}, "
                     f"{format_size(selection.size_bytes)}")
    else:
        ax.set_title("Sensitivity per layer")
    _save(fig, out, force)
    plt.close(fig)
    what = (f"{out}: predicted error of {n_l} layers x {n_c} sources (log colour, base first)"
            + (f", the selection's source marked in {marked} layers" if selection is not None else ""))
    return what, ax


def forest(result: dict, out: str, *, force: bool = False, categories: bool = True):
    """``result``: an fle-bracket JSON result."""
    plt = _pyplot()
    an = result["analysis"]
    rows = []  # (label, change, low, high, valid, is_total)
    for c in an["candidates"]:
        iv = c["interval"]
        rows.append((c["name"], iv["change"], iv["low"], iv["high"], c["valid"], True))
        if categories:
            for k, e in c["categories"].items():
                if "low" in e:
                    rows.append((f"  {k} (n={e['n']})", e["change"], e["low"], e["high"], c["valid"], False))
    if not rows:
        raise FleError("the bracket has no candidates to plot")
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.4 * len(rows)))
    y = np.arange(len(rows))[::-1]
    for yy, (label, ch, lo, hi, valid, total) in zip(y, rows):
        colour = ("C0" if total else "C1") if valid else "0.6"
        ax.errorbar([100 * ch], [yy], xerr=[[100 * (ch - lo)], [100 * (hi - ch)]], fmt="D" if total else "o",
                    color=colour, capsize=3, markersize=7 if total else 5)
    ax.axvline(0, color="k", lw=1)
    ax.set_yticks(y, labels=[r[0] + ("" if r[4] else " (invalid)") for r in rows])
    ax.set_xlabel(f"decode speed change vs {an['reference']['name']} (%), 95 % interval")
    d = an["drift"]
    ax.set_title(f"Paired bracket: reference drift {100 * d['change']:+.2f} % "
                 f"({'valid' if d['valid'] else 'outside the limit'})")
    ax.grid(True, axis="x", alpha=0.3)
    _save(fig, out, force)
    plt.close(fig)
    n_c = len(an["candidates"])
    what = (f"{out}: decode speed change of {n_c} candidate{'s' if n_c != 1 else ''} against "
            f"{an['reference']['name']} with 95 % bootstrap intervals"
            + (", overall and per category" if categories else ""))
    return what, ax


def hit_rate(stats: dict, out: str, *, window: int = 64, force: bool = False):
    """``stats``: ``fle.engine-stats/1`` (``fle-engine generate --stats-json``):
    the expert cache's hit rate per decode step and its moving average."""
    plt = _pyplot()
    if stats.get("format") != "fle.engine-stats/1":
        raise FleError(f"not engine statistics (format fle.engine-stats/1 expected, got {stats.get('format')!r})")
    req = stats.get("requests_per_step")
    hits = stats.get("hits")
    if not isinstance(req, int) or isinstance(req, bool) or req < 1:
        raise FleError(f"requests_per_step must be a positive integer, got {req!r}")
    if not isinstance(hits, list) or not hits or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= req for h in hits):
        raise FleError(f"hits must be a non-empty list of integers from 0 to {req} (one per step)")
    rate = np.asarray(hits, np.float64) / req
    w = max(1, min(int(window), len(rate)))
    avg = np.convolve(rate, np.ones(w) / w, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    steps = np.arange(len(rate))
    ax.plot(steps, rate, ".", color="0.7", markersize=2, label="per step")
    ax.plot(steps[w - 1:], avg, color="C0", lw=2, label=f"moving mean over {w} steps")
    ax.set_xlabel("decode step")
    ax.set_ylabel("expert cache hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"Hit rate over time: {rate.mean():.3f} overall, {rate[-w:].mean():.3f} over the last {w} steps")
    ax.legend(loc="lower right")
    ax.grid(True, alpha=0.3)
    _save(fig, out, force)
    plt.close(fig)
    return (f"{out}: the expert cache's hit rate over {len(rate)} decode steps ({req} routed experts per step), "
            f"per step and as a moving mean"), ax


def rank_correlation(x, y) -> float:
    """Spearman's rank correlation (scipy), NaN when either side is constant."""
    from scipy.stats import spearmanr

    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.size < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(spearmanr(x, y).statistic)


def predicted_vs_measured(names: list[str], predicted: list[float], klds: list[float], ses: list[float], out: str,
                          *, force: bool = False):
    """Each built file's summed predicted error (its selection) against its
    measured mean KLD, with Spearman's rank correlation in the title."""
    if len(names) < 2:
        raise FleError("give at least two files (--file) to compare predicted and measured error")
    plt = _pyplot()
    rho = rank_correlation(predicted, klds)
    fig, ax = plt.subplots(figsize=(6.5, 5))
    ax.errorbar(predicted, klds, yerr=ses, fmt="o", capsize=3, markeredgecolor="k")
    for n, x, y in zip(names, predicted, klds):
        ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("predicted summed error (selection)")
    ax.set_ylabel("measured mean KLD vs base")
    ax.set_title(f"Predicted vs measured: Spearman rho = {rho:.3f} (n={len(names)})")
    ax.grid(True, alpha=0.3)
    _save(fig, out, force)
    plt.close(fig)
    what = (f"{out}: summed predicted error against measured mean KLD (±1 standard error) for {len(names)} "
            f"files, Spearman rank correlation {rho:.3f}")
    return what, ax, rho


def comparison(result: dict, out: str, *, force: bool = False):
    """``result``: an ``fle-compare`` result. Two panels over file size:
    mean KLD per text (±1 standard error) and the decode speed change
    against the reference file with its 95 % interval (the reference at 0)."""
    plt = _pyplot()
    rows = result["rows"]
    texts = result["texts"]
    if not rows:
        raise FleError("the comparison has no files to plot")
    unit, scale = ("GB", 1e9) if max(r["size_bytes"] for r in rows) >= 1e9 else ("MB", 1e6)
    fig, (ax_k, ax_s) = plt.subplots(1, 2, figsize=(11, 4.5), layout="constrained")
    for j, t in enumerate(texts):
        pts = [(r["size_bytes"] / scale, r["kld"][t]["kld_mean"], r["kld"][t]["kld_unc"]) for r in rows
               if t in r["kld"]]
        if pts:
            x, y, e = map(np.array, zip(*pts))
            ax_k.errorbar(x, y, yerr=e, fmt="os^Dvp"[j % 6], capsize=2, label=t, markeredgecolor="k")
    n_speed = 0
    for r in rows:
        x = r["size_bytes"] / scale
        for t in texts[:1]:
            if t in r["kld"]:
                ax_k.annotate(r["name"], (x, r["kld"][t]["kld_mean"]), textcoords="offset points", xytext=(4, 4),
                              fontsize=8)
        s = r["speed"][0] if r["speed"] else None
        if s is None:
            continue
        n_speed += 1
        if r["reference"]:
            ax_s.plot([x], [0.0], "*", color="k", markersize=11)
        else:
            ch, lo, hi = 100 * s["change"], 100 * s["low"], 100 * s["high"]
            ax_s.errorbar([x], [ch], yerr=[[ch - lo], [hi - ch]], fmt="o", capsize=3,
                          color="C0" if s["valid"] else "0.6", markeredgecolor="k")
        ax_s.annotate(r["name"], (x, 100 * s.get("change", 0.0)), textcoords="offset points", xytext=(4, 4),
                      fontsize=8)
    ax_s.axhline(0, color="k", lw=0.8)
    for ax in (ax_k, ax_s):
        ax.set_xlabel(f"file size ({unit})")
        ax.grid(True, alpha=0.3)
    ax_k.set_ylabel("mean KLD vs base")
    ax_k.set_title("Quality")
    if texts:
        ax_k.legend(title="text")
    ax_s.set_ylabel(f"decode speed change vs {rows[0]['name']} (%)")
    ax_s.set_title(f"Speed at an equal cache budget ({result['settings']['budget']})")
    _save(fig, out, force)
    plt.close(fig)
    what = (f"{out}: {len(rows)} files by size: mean KLD on {len(texts)} text{'s' if len(texts) != 1 else ''} "
            f"(±1 standard error) and decode speed change against {rows[0]['name']} with 95 % intervals "
            f"({n_speed} measured) at one cache budget")
    return what, (ax_k, ax_s)
