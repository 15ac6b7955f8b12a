"""The README is a short guide and the docs hold the depth: README.md stays under 300 lines, its first two code
blocks are the install-and-run and test commands (CI runs the second as it is written), and every relative link in
README.md, docs/ and benchmarks/results/ points to a file that exists and, with a ``#fragment``, to one of its
headings."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUN_COMMAND = "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && raytrain-eks train"
TEST_COMMAND = (
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && python3 scripts/fetch_test_tools.py '
    "&& python -m mypy && python -m pytest -q -n 2 --dist loadfile --tier all"
)
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    """The Markdown files whose links are checked."""
    return [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks" / "results").rglob("*.md"))]


def anchors(path: Path) -> set[str]:
    """The fragments GitHub gives the headings of ``path``: ``## Packing: whole rows`` -> ``packing-whole-rows``."""
    found: set[str] = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if match := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            slug, n = base, 0
            while slug in found:
                n += 1
                slug = f"{base}-{n}"
            found.add(slug)
    return found


def test_readme_is_a_short_guide():
    lines = len(README.read_text().splitlines())
    assert lines < 300, f"README.md has {lines} lines; move the depth to docs/ and link it"


def test_readme_opens_with_the_run_and_test_commands():
    blocks = [block.strip() for block in FENCE.findall(README.read_text())]
    assert blocks[:2] == [RUN_COMMAND, TEST_COMMAND]


def test_ci_runs_the_readme_test_command_as_written():
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


def test_every_relative_link_resolves():
    broken = []
    for page in pages():
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, fragment = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{where} (no heading #{fragment})")
    assert not broken, "\n".join(broken)
