"""The README against what it quotes: its size, the main run's output (an excerpt of the committed transcript,
never retyped), the test commands CI runs, and its links."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_readme_is_short():
    assert len(README.encode()) <= 15_000


def test_the_main_runs_output_is_an_excerpt_of_its_transcript():
    block = README.split("```\nswarm: demo churn", 1)[1].split("```", 1)[0]
    transcript = set((ROOT / "docs/results/main-run.txt").read_text().splitlines())
    lines = ["swarm: demo churn" + block.splitlines()[0]] + block.splitlines()[1:]
    missing = [line for line in lines if line.strip() and line != "..." and line not in transcript]
    assert not missing, missing


def test_ci_runs_the_full_suite_as_the_readme_writes_it():
    assert "make test-all" in README and "make test " in README
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert "make test-all" in ci
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: ", makefile, re.M) and re.search(r"^test-all: ", makefile, re.M)


def test_every_relative_link_of_the_readme_exists():
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)", README) if not re.match(r"[a-z]+:", t)]
    assert targets and not [t for t in targets if not (ROOT / t).exists()]


def test_the_benchmark_tables_quoted_in_benchmarks_readme_are_copies_of_their_result_files():
    """A table under `<!-- from FILE -->` in benchmarks/README.md is FILE's, line for line (never retyped)."""
    text = (ROOT / "benchmarks/README.md").read_text()
    quoted = re.findall(r"<!-- from (\S+) -->\n((?:\|.*\n)+)", text)
    assert len(quoted) >= 2
    for path, table in quoted:
        lines = set((ROOT / path).read_text().splitlines())
        assert not [row for row in table.splitlines() if row not in lines], path
