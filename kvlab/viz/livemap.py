"""Pictures of a cache's live map (slot -> ledger row) before and after surgery.
Reads a cache's mirror; draws, and changes nothing.

Input: :meth:`KVCache.ledger_frame` tables (``row``, ``token_id``, ``position``, ``origin``,
``status``) and the live maps (lists of ledger rows). Returns a matplotlib Figure; never saves.
"""
from __future__ import annotations

from typing import Sequence

ORIGIN_COLORS = {"written": "#999999", "inserted": "#1b9e77", "replacement": "#7570b3", "added": "#d95f02",
                 "rebuilt": "#e7298a", "moved_to": "#66a61e"}  # moved_to: re-rotated to a new position


def live_map_figure(ledger, maps: dict[str, Sequence[int]], labels=None, title: str = "live map"):
    """One panel per live map: x = slot, y = the ledger row it points at (colour = how the row was
    written); the lower panel shows each slot's RoPE position. ``labels``: ``token_id -> str``
    (e.g. the tokenizer's decode) to annotate slots whose row is not original."""
    from kvlab.harness.figures import new_figure

    fig = new_figure(figsize=(12, 2.4 * len(maps) + 1.6))
    axes = fig.subplots(len(maps) + 1, 1, squeeze=False)[:, 0]
    origin = ledger.set_index("row")["origin"]
    position = ledger.set_index("row")["position"]
    token = ledger.set_index("row")["token_id"]
    for ax, (name, live) in zip(axes, maps.items()):
        colors = [ORIGIN_COLORS.get(origin[r], "black") for r in live]
        ax.scatter(range(len(live)), live, c=colors, s=14)
        ax.plot(range(len(live)), live, color="#cccccc", linewidth=0.6, zorder=0)
        for s, r in enumerate(live):
            if origin[r] != "written" and labels is not None:
                ax.annotate(repr(labels(int(token[r])))[1:-1], (s, r), textcoords="offset points", xytext=(0, 6),
                            fontsize=7, ha="center", rotation=60)
        ax.set_ylabel("ledger row")
        ax.set_title(f"{name}: {len(live)} slots")
        ax.grid(linestyle=":", linewidth=0.5)
    ax = axes[-1]
    for name, live in maps.items():
        ax.plot(range(len(live)), [position[r] for r in live], marker=".", markersize=3, linewidth=0.8, label=name)
    ax.set_xlabel("slot")
    ax.set_ylabel("RoPE position")
    ax.legend(fontsize=8)
    ax.grid(linestyle=":", linewidth=0.5)
    handles = [axes[0].scatter([], [], c=c, s=14, label=k) for k, c in ORIGIN_COLORS.items()]
    axes[0].legend(handles=handles, fontsize=7, ncol=len(handles), loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
