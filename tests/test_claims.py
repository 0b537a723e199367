"""Every sentence of the documentation that states a measured number, ranking or comparison is rendered from its
result file or paired with a named claim (experiments/prose.py) whose check over that file holds (issue 39)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from experiments.prose import CLAIMS, DOCUMENTS, MARKER, failures

ROOT = Path(__file__).resolve().parent.parent


def _docs() -> list[Path]:
    out = []
    for d in DOCUMENTS:
        p = ROOT / d
        out += sorted(p.rglob("*.md")) if p.is_dir() else [p]
    return out


def _flat(text: str) -> str:
    return " ".join(text.split())


def _report(found) -> str:
    return "\n".join(f'claim {c.name} no longer holds ({why}; it reads {", ".join(c.files)}): "{c.sentence}" '
                     f"in {c.doc}" for c, why in found)


def test_every_claim_holds_on_the_committed_results():
    found = failures(ROOT)
    assert not found, _report(found)


def test_every_claim_stands_in_its_document_before_its_marker():
    for c in CLAIMS.values():
        text = _flat((ROOT / c.doc).read_text())
        marker = f"<!-- claim: {c.name} -->"
        assert marker in text, f"{c.doc} has no {marker}"
        before = text[: text.index(marker)]
        assert c.sentence in before[-(len(c.sentence) + 400):], f'{c.doc}: "{c.sentence}" does not precede {marker}'


def test_every_marker_names_a_claim():
    for path in _docs():
        for name in MARKER.findall(path.read_text()):
            assert name in CLAIMS, f"{path.relative_to(ROOT)}: <!-- claim: {name} --> names no claim in experiments/prose.py"


def test_every_rendered_document_says_what_its_files_say():
    from experiments.readme import DOCUMENTS as RENDERED, stale_regions

    for doc in RENDERED:
        stale = stale_regions((ROOT / doc).read_text(), ROOT / "experiments" / "results")
        assert not stale, f"{doc}: regions {stale} differ from the result files: checkfree experiment report --readme all"


def test_a_changed_number_fails_the_claim_that_rests_on_it_naming_its_sentence(tmp_path):
    """In a copy of the results, one rebuild of the SmolLM2 study made free (its loss after the rebuild set to the
    saved state's): the recommendation's claims fail, and the report names their sentences."""
    shutil.copytree(ROOT / "experiments" / "results", tmp_path / "experiments" / "results")
    path = tmp_path / "experiments/results/pretrained/smollm2/results.json"
    data = json.loads(path.read_text())
    v0 = data["trunks"]["plain"]["points"]["10"]["val"]
    run = next(r for r in data["runs"].values() if r.get("recovered_val") is not None)
    run["recovered_val"] = v0 - 0.01
    path.write_text(json.dumps(data))
    found = failures(tmp_path)
    names = {c.name for c, _ in found}
    assert {"smollm2-every-rebuild-sets-back", "readme-recommendation"} <= names
    text = _report(found)
    assert "every rebuild tried, averaging the neighbours included, set it back" in text and "README.md" in text
    assert re.search(r"claim readme-recommendation no longer holds \(its check is false", text)


# ---- the experiment and benchmark pages: every number rendered or checked against its file (benchmark_prose) ----


def test_every_number_of_the_experiment_and_benchmark_pages_is_rendered_or_checked_against_its_file():
    from experiments.benchmark_prose import unchecked

    found = unchecked(ROOT)
    assert not found, "\n".join(map(str, found))


def test_a_changed_number_in_a_result_file_fails_naming_its_sentence(tmp_path):
    """A copy of the repository's pages and files with one number of benchmarks/results/dashboard.txt changed: the
    sentence of docs/dashboard.md that quotes it is named, with the number and the file."""
    from experiments.benchmark_prose import FROM, PAGES, unchecked

    for page in PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    for page in PAGES:
        for files in FROM.findall((ROOT / page).read_text()):
            for f in files.split():
                (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / f, tmp_path / f)
    assert unchecked(tmp_path) == []
    path = tmp_path / "benchmarks/results/dashboard.txt"
    path.write_text(path.read_text().replace("0.80 ms per request", "0.90 ms per request"))
    found = unchecked(tmp_path)
    assert found and {(u.page, u.number) for u in found} == {("docs/dashboard.md", "0.80")}, found
    assert "The coordinator spent 0.80 ms of CPU per request" in found[0].sentence
    assert "benchmarks/results/dashboard.txt" in str(found[0])


def test_a_number_outside_a_rendered_region_without_a_marker_fails(tmp_path):
    from experiments.benchmark_prose import unchecked

    (tmp_path / "r.txt").write_text("median 0.312 s, 14.2% of a core, 1.391 CPU-s, 3.15 MB, 0.0090 CPU-s/s, 50_000\n")
    (tmp_path / "page.md").write_text(
        "Measured: 0.312 s a step, 14 % of a core. <!-- from r.txt -->\n\n"
        "A step took 0.5 s.\n\n"
        "Rounded: 1.39 and 1.4 CPU-s, 3.1 or 3.2 MB, 0.9% of a core, 50,000 tokens; not 1.38. <!-- from r.txt -->\n\n"
        "<!-- BEGIN rendered: x -->9.99 s<!-- END rendered: x --> and `--steps 30` and\n\n"
        "```\n123 456\n```\n\n"
        "<!-- from r.txt -->\n| a | b |\n|---|---|\n| 0.312 | 7.5 |\n\n"
        "| after | 1.391 | 8.5 |\n<!-- from r.txt -->\n\n"
        "1. **A numbered item** of section\n\n## 2. A numbered heading\n\n"
        "Issue 39, Fig. 2, commit 953dbea, int8, SmolLM2, 127.0.0.1 hold no measured number.\n")
    found = unchecked(tmp_path, ["page.md"])
    assert [(u.number, u.why.split(" ")[0]) for u in found] == [
        ("0.5", "neither"), ("1.38", "not"), ("7.5", "not"), ("8.5", "not")], found


def test_a_seed_and_a_numbered_schedule_are_no_measured_numbers():
    """A seed names a run and `#N` a schedule of a dst run (docs/dst.md: "the seed-41 soak's #974"); neither is
    what the run measured. The counts beside them still are."""
    from experiments.benchmark_prose import numbers

    assert numbers("seed 41, seeds 7 and 9, the seed-12 soak's #236 and #103: 329 schedules, 6 divergences") == [
        "329", "6"]
    assert numbers("schedule #974 diverged at step 5 (20 replays, 6 outcomes)") == ["5", "20", "6"]


def test_every_page_of_the_manual_is_scanned():
    from experiments.benchmark_prose import PAGES

    missing = sorted(p for p in (str(f.relative_to(ROOT)) for f in (ROOT / "docs").glob("*.md")) if p not in PAGES)
    assert not missing, f"docs pages not in experiments.benchmark_prose.PAGES: {missing}"
