#!/usr/bin/env python3
"""Checks that every figure the README quotes is backed by docs/benchmarks.md.

The README's "Measured" table (header ``| what | measured | where |``) links
each row to a section of docs/benchmarks.md. For every row, each number in
its "measured" cell (``421 ms``, ``5.943e-15``, ``1.43x``, ``65,440 MiB``)
must appear in that section, and the section must name the command that made
it (a code span or block running ``contrax``, ``tools/``, ``python`` or
``bash``). Run by CTest (``readme_figures``):

  python3 tools/check_readme_figures.py README.md docs/benchmarks.md

Exit status 0 when every figure is found, 1 otherwise (each miss printed).
"""
import re
import sys

_NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:e-?\d+)?x?")
_COMMAND = re.compile(r"`[^`]*\b(contrax|tools/|python|bash|sh tools)[^`]*`|```")


def slug(heading):
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def sections(markdown):
    """{anchor: text} of every heading's section (up to the next heading)."""
    out, anchor, lines = {}, None, []
    for line in markdown.splitlines():
        m = re.match(r"^#{1,6} (.*)$", line)
        if m:
            if anchor is not None:
                out[anchor] = "\n".join(lines)
            anchor, lines = slug(m.group(1)), []
        else:
            lines.append(line)
    if anchor is not None:
        out[anchor] = "\n".join(lines)
    return out


def measured_rows(readme):
    """(measured cell, anchor) of each row of the README's Measured table."""
    rows, inside = [], False
    for line in readme.splitlines():
        if line.startswith("| what | measured | where |"):
            inside = True
            continue
        if inside and not line.startswith("|"):
            break
        if inside and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            anchor = re.search(r"docs/benchmarks\.md#([\w\-]+)", cells[2])
            rows.append((cells[0], cells[1], anchor.group(1) if anchor else None))
    return rows


def main(readme_path, benchmarks_path):
    readme, bench = open(readme_path).read(), open(benchmarks_path).read()
    found = sections(bench)
    rows, problems = measured_rows(readme), []
    if not rows:
        problems.append("the README has no Measured table (| what | measured | where |)")
    for what, measured, anchor in rows:
        if anchor is None or anchor not in found:
            problems.append("row '%s': its 'where' cell links no section of docs/benchmarks.md (%s)" % (what, anchor))
            continue
        text = found[anchor]
        if not _COMMAND.search(text):
            problems.append("row '%s': section #%s names no command" % (what, anchor))
        for figure in _NUMBER.findall(measured.replace("*", "")):
            if len(figure.strip(",.")) < 2 and not figure.endswith("x"):
                continue  # single digits ("W = 2"): words, not figures
            if figure.rstrip(",.") not in text:
                problems.append("row '%s': %s is not in section #%s" % (what, figure.rstrip(",."), anchor))
    for p in problems:
        print("readme_figures: " + p)
    print("readme_figures: %d rows, %s" % (len(rows), "every figure found" if not problems else "%d missing" % len(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
