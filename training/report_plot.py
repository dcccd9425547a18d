"""The hit-rate-over-time figure of an evaluation report (`policy.over_time`): one panel per capacity,
one line per policy, ticks where the online learner swapped weights in."""
from __future__ import annotations

STYLES = {"lru": ("s-", "LRU"), "dmlp": ("o-", "DMLP offline"), "dmlp_guarded": ("v-", "DMLP offline + guard"),
          "dmlp_online": ("D-", "DMLP online + guard"), "dmlp_online_unguarded": ("x:", "DMLP online, no guard"),
          "lfu": ("^:", "LFU"), "belady": ("k--", "Belady (oracle)")}


def plot_over_time(report: dict, path: str, capacities=(0.05, 0.1, 0.2, 0.4), title: str = "") -> None:
    """Writes a PNG to `path`. capacities: the panels (those the report has)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pol = report["policy"]
    ot = pol["over_time"]
    caps = [c for c in capacities if c in pol["capacity_frac"]] or pol["capacity_frac"][:4]
    fig, axes = plt.subplots(1, len(caps), figsize=(4.2 * len(caps), 3.8), sharey=False, squeeze=False)
    t_s = [t / 1000.0 for t in ot["t_ms"]]
    swaps = [t / 1000.0 for t in report.get("online", {}).get("swap_ms", [])]
    for ax, c in zip(axes[0], caps):
        ci = pol["capacity_frac"].index(c)
        for name, series in ot["hit_rate"].items():
            if name in ("belady", "lfu") or not series:
                continue
            style, label = STYLES.get(name, ("-", name))
            ax.plot(t_s, series[ci], style, ms=3, lw=1, label=label)
        for x in swaps:
            ax.axvline(x, color="0.85", lw=0.5, zorder=0)
        ax.set_title(f"capacity {c:g}", fontsize=9)
        ax.set_xlabel("simulated time (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("block hit rate per time bin")
    axes[0][-1].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
