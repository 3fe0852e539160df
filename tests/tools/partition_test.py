"""Every test case of every layer's test program runs in exactly one CTest
test (tests/CMakeLists.txt gives each file of tests/<layer>/ a test that runs
the layer's program with a filter of the file's cases, read from the sources
at configure time): a case that no filter names would never run, a case that
two name would run twice. Also checks that the check can fail: a case left
out of the filters, and one named twice, are reported.

    partition_test.py PROGRAM FILTERS [PROGRAM FILTERS ...]

FILTERS holds a line per CTest test, "NAME FILTER" (GoogleTest's filter:
patterns separated by ':', with '*' and '?').
"""
import fnmatch
import subprocess
import sys


def cases_of(program):
    """The full names of the program's test cases, from --gtest_list_tests."""
    out = subprocess.run([program, "--gtest_list_tests"], check=True, stdout=subprocess.PIPE, text=True,
                         timeout=60).stdout
    cases, suite = [], None
    for line in out.splitlines():
        if not line.strip():
            continue
        name = line.split("#")[0].strip()  # "  Name  # GetParam() = ..." for parameterised cases
        if not line.startswith(" "):
            suite = name
        else:
            cases.append(suite + name)
    return cases


def problems(cases, filters):
    """What breaks the partition: cases named by no filter or by several."""
    found = []
    for case in cases:
        owners = [test for test, patterns in filters if any(fnmatch.fnmatchcase(case, p) for p in patterns)]
        if len(owners) != 1:
            found.append(f"{case}: run by {len(owners)} tests ({', '.join(owners) or 'none'}), expected 1")
    return found


def read_filters(path):
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                test, flt = line.split()
                rows.append((test, flt.split(":")))
    return rows


def main(argv):
    if len(argv) < 2 or len(argv) % 2:
        print(__doc__)
        return 2
    failed = False
    for program, path in zip(argv[0::2], argv[1::2]):
        cases, filters = cases_of(program), read_filters(path)
        found = problems(cases, filters)
        # The check can fail: a case without a test, and one with two.
        assert problems(["Nowhere.Case"], filters) == ["Nowhere.Case: run by 0 tests (none), expected 1"], \
            "a case of no test went unreported"
        assert problems(["Twice.Case"], [("one", ["Twice.*"]), ("two", ["*.Case"])]) == [
            "Twice.Case: run by 2 tests (one, two), expected 1"], "a case of two tests went unreported"
        for p in found:
            print(f"FAIL: {program}: {p}")
        failed = failed or bool(found)
        print(f"{'FAIL' if found else 'ok'}: {program}: {len(cases)} cases in {len(filters)} tests")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
