#!/usr/bin/env python3
"""Checks that every figure the README quotes is backed by docs/benchmarks.md.

The README's "Measured" table (header ``| what | measured | where |``) links
each row to a section of docs/benchmarks.md. For every row, each number in
its "measured" cell (``421 ms``, ``5.943e-15``, ``1.43x``, ``65,440 MiB``)
must appear in that section, and the section must name the command that made
it (a code span or block running ``contrax``, ``tools/``, ``python`` or
``bash``). A paragraph of prose that links a section of docs/benchmarks.md
vouches for its figures the same way: each number with a unit (``19.3
minutes``, ``0.44 s``, ``1.56x``, ``175 MB``) must appear in that section with
the unit (minutes written ``min``), unless the README says it is rounded
(``about 20 minutes``). Run by CTest (``readme_figures``, and
``readme_figures_check`` that shows it can fail):

  python3 tools/check_readme_figures.py README.md docs/benchmarks.md

Exit status 0 when every figure is found, 1 otherwise (each miss printed).
"""
import re
import sys

_NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:e-?\d+)?x?")
_UNIT_FIGURE = re.compile(r"(?<![\w.])(about |under |at most )?(\d[\d,]*(?:\.\d+)?)"
                          r"(x\b| ?(?:minutes?|min|ms|s|MiB|GiB|MB|GB)\b)")
_LINK = re.compile(r"docs/benchmarks\.md#([\w\-]+)")
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


def prose_figures(readme):
    """(figure as the section must hold it, anchor) of each figure with a unit
    in a paragraph of prose (not a table, not code) that links a section."""
    out, fenced = [], False
    paragraphs, lines = [], []
    for line in readme.splitlines() + [""]:
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("|") or not line.strip():
            if lines:
                paragraphs.append(" ".join(lines))
            lines = []
        else:
            lines.append(line)
    for text in paragraphs:
        anchors = set(_LINK.findall(text))
        if len(anchors) != 1:
            continue  # no section, or several: which one vouches is not said
        anchor = anchors.pop()
        for rounded, number, unit in _UNIT_FIGURE.findall(text.replace("*", "")):
            if not rounded:
                unit = unit.strip()
                unit = "x" if unit == "x" else " " + ("min" if unit.startswith("min") else unit)
                out.append((number + unit, anchor))
    return out


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
    prose = prose_figures(readme)
    for figure, anchor in prose:
        if anchor not in found:
            problems.append("the prose's link to #%s leads to no section of docs/benchmarks.md" % anchor)
        elif figure not in found[anchor].replace("\n", " "):
            problems.append("the prose's %s is not in section #%s" % (figure, anchor))
    for p in problems:
        print("readme_figures: " + p)
    print("readme_figures: %d rows and %d figures of prose, %s" %
          (len(rows), len(prose), "every figure found" if not problems else "%d missing" % len(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
