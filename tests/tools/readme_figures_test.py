"""tools/check_readme_figures.py can fail: on a README and a docs/benchmarks.md
made here, it passes where every figure is in its section, and names each
miss otherwise (a table's figure, a figure of prose, a section without its
command, a link to no section), while a figure the README says is rounded
("about 12 minutes") needs no match.

    readme_figures_test.py CHECKER
"""
import os
import subprocess
import sys
import tempfile

BENCH = """# Benchmarks

## Losses timed

`contrax bench losses --batch 4096` took 421 ms, **2.2x** the peer's 189 ms.

## The two commands

`bash tools/test.sh` 1,157 s, 19.3 min.

## Words only

Nothing was run here: 5.5 s.
"""

README = """# A project

| what | measured | where |
| --- | --- | --- |
| loss | {table} ms (peer 189 ms: **2.2x**) | [b](docs/benchmarks.md#losses-timed) |

Command 2 takes about 12 minutes, {prose} minutes on one machine ([timed](docs/benchmarks.md#{anchor})).
"""


def check(checker, readme, bench=BENCH):
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, "README.md"), os.path.join(tmp, "benchmarks.md")]
        for path, text in zip(paths, (readme, bench)):
            with open(path, "w") as f:
                f.write(text)
        r = subprocess.run([sys.executable, checker] + paths, stdout=subprocess.PIPE, text=True, timeout=60)
        return r.returncode, r.stdout


def main(checker):
    failures = []

    def expect(name, result, status, says):
        code, out = result
        if code != status or says not in out:
            failures.append("%s: expected status %d and '%s', got %d:\n%s" % (name, status, says, code, out))

    good = README.format(table="421", prose="19.3", anchor="the-two-commands")
    expect("all found", check(checker, good), 0, "1 rows and 1 figures of prose, every figure found")
    expect("table", check(checker, README.format(table="420", prose="19.3", anchor="the-two-commands")), 1,
           "row 'loss': 420 is not in section #losses-timed")
    expect("prose", check(checker, README.format(table="421", prose="19.4", anchor="the-two-commands")), 1,
           "the prose's 19.4 min is not in section #the-two-commands")
    expect("no section", check(checker, README.format(table="421", prose="19.3", anchor="gone")), 1,
           "the prose's link to #gone leads to no section")
    expect("no command", check(checker, good.replace("losses-timed", "words-only")), 1,
           "section #words-only names no command")
    for name in failures:
        print(name)
    print("readme_figures_check: %d of 5 cases as expected" % (5 - len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
