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
