"""Whether two runs trained the same curve, bit for bit: the check that a run
stopped and resumed equals an uninterrupted one (tools/gpu_check.sh --quick).

    python tools/same_curve.py WHOLE/metrics.jsonl RESUMED/metrics.jsonl

Compares the loss and learning rate of every step both files hold (the JSON
numbers are written with round-trip precision, so equal text is equal bits);
exits 1 naming the first step that differs, or when the files share no step
or the second is missing steps of the first.
"""
import json
import sys


def curve(path):
    steps = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                m = json.loads(line)
                steps[m["step"]] = (m["loss"], m["lr"], m["rows"])
    return steps


def main():
    if len(sys.argv) != 3:
        print("usage: same_curve.py WHOLE/metrics.jsonl RESUMED/metrics.jsonl", file=sys.stderr)
        sys.exit(2)
    whole, resumed = curve(sys.argv[1]), curve(sys.argv[2])
    missing = sorted(set(whole) - set(resumed))
    if not whole or missing:
        print(f"same_curve: {sys.argv[2]} lacks steps {missing[:5]} of {sys.argv[1]}" if whole else
              f"same_curve: {sys.argv[1]} holds no step")
        sys.exit(1)
    for step in sorted(whole):
        if whole[step] != resumed[step]:
            print(f"same_curve: step {step} differs: loss, lr, rows {whole[step]} against {resumed[step]}")
            sys.exit(1)
    print(f"same_curve: steps {min(whole)}-{max(whole)} equal bit for bit (final loss {whole[max(whole)][0]!r})")


if __name__ == "__main__":
    main()
