"""PNG of one scaling simulation, laid out like the thesis figures 3.4-3.6."""

from __future__ import annotations

from typing import Any


def plot_run(res: Any, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(len(res.load)))
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    ax1.plot(steps, res.load, color="tab:blue", label="load (records/step, all operators)")
    ax1.set_ylabel("load")
    twin = ax1.twinx()
    twin.plot(steps, res.instances, color="tab:red", label="instances")
    twin.plot(steps, res.ideal, color="tab:orange", linestyle="--", label="ideal instances")
    twin.set_ylabel("instances")
    lines = ax1.get_lines() + twin.get_lines()
    ax1.legend(lines, [ln.get_label() for ln in lines], loc="upper left", fontsize=8)
    c = res.config
    ax1.set_title(f"{c.baseline} scaling, {c.load} load, seed {c.seed}"
                  + (", r_secure" if c.r_secure else ""))
    ax2.plot(steps, res.accuracy, color="tab:blue", label="accuracy (instances / ideal)")
    ax2.axhline(1.0, color="grey", linewidth=0.8)
    ax2b = ax2.twinx()
    ax2b.plot(steps, res.throughput_pct, color="tab:green", label="% of ideal throughput")
    ax2b.set_ylabel("% ideal throughput")
    lines = ax2.get_lines()[:1] + ax2b.get_lines()
    ax2.legend(lines, [ln.get_label() for ln in lines], loc="lower left", fontsize=8)
    ax2.set_ylabel("accuracy")
    ax3.bar(steps, res.messages, color="tab:purple", width=1.0)
    ax3.set_ylabel("protocol messages")
    ax3.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
