"""The GPU check's decision on the fused CUDA kernels (tools/gpu_check.sh --quick).

Reads two runs of python/bench/gpu_losses.py --json, one with the ATen
element-wise passes (CONTRAX_FUSED_KERNELS unset) and one with the fused
kernels (CONTRAX_FUSED_KERNELS=1), prints for each loss and batch size the
fused path beside the ATen path and the peers, and ends with one line: whether
the fused kernels are exact (the check's exactness steps passed: --exact) and
faster (their median below the ATen path's at every loss and batch size) on
that GPU, and so may become the default (docs/engine.md says how).

    python tools/fused_verdict.py aten.json fused.json --exact 1

Exit status 0 when the verdict is to switch them on, 1 when not, 2 on
unreadable input.
"""
import argparse
import json
import sys

CONTRAX = {"clip": "Contrax clip_loss", "siglip": "Contrax siglip_loss"}


def load(path):
    with open(path) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def cell(r):
    return r if isinstance(r, str) else f"{r[0]:.2f} ms"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("aten")
    p.add_argument("fused")
    p.add_argument("--exact", type=int, choices=[0, 1], required=True,
                   help="1 when every exactness step (kernel tests, sanitizers, verify) passed")
    args = p.parse_args()
    try:
        aten, fused = load(args.aten), load(args.fused)
    except (OSError, ValueError, IndexError) as e:
        print(f"fused_verdict.py: cannot read the benchmark runs: {e}", file=sys.stderr)
        sys.exit(2)

    def result(run, loss, impl, rows):
        return next((x["result"] for x in run["results"] if x["loss"] == loss and x["impl"] == impl and x["B"] == rows),
                    "not run")

    batches = sorted({x["B"] for x in aten["results"]})
    print(f"{aten['device']}, torch {aten['torch']}, CUDA {aten['cuda']}, {aten['dtype']}, d = {aten['width']}: "
          "median forward + backward")
    print("| loss | B | Contrax, fused kernels | Contrax, ATen passes | plain PyTorch and the peers |")
    print("|---|---|---|---|---|")
    slower = []
    for loss, impl in CONTRAX.items():
        peers = sorted({x["impl"] for x in aten["results"] if x["loss"] == loss and x["impl"] != impl})
        for rows in batches:
            f, a = result(fused, loss, impl, rows), result(aten, loss, impl, rows)
            if isinstance(f, str) or isinstance(a, str) or f[0] >= a[0]:
                slower.append(f"{loss} B = {rows} ({cell(f)} fused, {cell(a)} ATen)")
            print(f"| {loss} | {rows} | {cell(f)} | {cell(a)} | " +
                  "; ".join(f"{p} {cell(result(aten, loss, p, rows))}" for p in peers) + " |")
    device = aten["device"]
    if args.exact and not slower:
        print(f"VERDICT: the fused CUDA kernels are exact and faster on {device} at every loss and batch size: "
              "they may become the default (docs/engine.md, 'Making the fused kernels the default')")
        return 0
    reasons = ([] if args.exact else ["an exactness step failed"]) + [f"not faster at {s}" for s in slower]
    print(f"VERDICT: keep the fused CUDA kernels opt-in on {device}: " + "; ".join(reasons))
    return 1


if __name__ == "__main__":
    sys.exit(main())
