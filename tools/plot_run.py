#!/usr/bin/env python3
"""Draws RUN_DIR/curves.png from RUN_DIR/metrics.jsonl: loss, learning rate and
throughput against the step. Run by `contrax train` at the end of a run and by
`contrax plot RUN_DIR`; usable on its own: python3 tools/plot_run.py RUN_DIR.

Exit status: 0 drawn, 1 bad input (no or unreadable metrics), 3 matplotlib missing.
Steps whose update was skipped (non-finite loss or gradient) are marked; their
loss is null in the file and is not drawn.
"""
import json
import math
import os
import secrets
import sys


def main(argv):
    if len(argv) != 2:
        print("usage: plot_run.py RUN_DIR", file=sys.stderr)
        return 1
    run_dir = argv[1]
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = []
    try:
        # The run directory's files are opened by name in the opened
        # directory and never through a link (docs/reliability.md).
        dir_fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        with os.fdopen(os.open("metrics.jsonl", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)) as f:
            for n, line in enumerate(f, 1):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    print(f"contrax plot: {path} line {n} is not JSON: {e}", file=sys.stderr)
                    return 1
    except OSError as e:
        print(f"contrax plot: cannot read {path}: {e.strerror}", file=sys.stderr)
        return 1
    if not rows:
        print(f"contrax plot: {path} has no steps to draw", file=sys.stderr)
        return 1
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        print("contrax plot: matplotlib is missing, curves.png not drawn "
              f"({sys.executable} -m pip install matplotlib, or set CONTRAX_PYTHON "
              "to a python3 that has it)", file=sys.stderr)
        return 3

    def series(key):
        xs, ys = [], []
        for r in rows:
            v = r.get(key)
            if v is not None and math.isfinite(v):
                xs.append(r["step"])
                ys.append(v)
        return xs, ys

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    # A short last batch of an epoch has fewer negatives, hence a lower loss:
    # drawn as points of their own, not as dips in the line of full batches.
    full_rows = max(r["rows"] for r in rows)
    line = [(r["step"], r["loss"]) for r in rows
            if r.get("loss") is not None and math.isfinite(r["loss"]) and r["rows"] == full_rows]
    axes[0].plot([s for s, _ in line], [v for _, v in line], lw=1, color="tab:blue",
                 label="loss (global mean, full batches)")
    short = [(r["step"], r["loss"]) for r in rows
             if r.get("loss") is not None and math.isfinite(r["loss"]) and r["rows"] < full_rows]
    if short:
        axes[0].scatter([s for s, _ in short], [v for _, v in short], s=12, color="tab:orange",
                        label="short last batch of an epoch", zorder=3)
    bad = [r["step"] for r in rows if not r.get("applied", True)]
    for s in bad:
        axes[0].axvline(s, color="tab:red", lw=0.8, alpha=0.6)
    if bad:
        axes[0].plot([], [], color="tab:red", lw=0.8, label="skipped (non-finite)")
    axes[0].set_ylabel("loss")
    axes[0].legend(loc="upper right")
    x, y = series("lr")
    axes[1].plot(x, y, lw=1, color="tab:green")
    axes[1].set_ylabel("learning rate")
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    x, y = series("examples_per_s")
    axes[2].plot(x, y, lw=1, color="tab:purple")
    axes[2].set_ylabel("examples/s (since start)")
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
    epochs = max(r["epoch"] for r in rows)
    fig.suptitle(f"{os.path.basename(os.path.normpath(run_dir))}: {rows[-1]['step']} steps, {epochs} epoch(s)")
    fig.tight_layout()
    out = os.path.join(run_dir, "curves.png")
    # A temporary nobody can plant a link at (created exclusively, under a
    # random name), renamed over curves.png: never a half-written picture.
    tmp = "curves.png.tmp.%d.%s" % (os.getpid(), secrets.token_hex(8))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as f:
        fig.savefig(f, dpi=100, format="png")
    os.replace(tmp, "curves.png", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    print(f"contrax plot: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
