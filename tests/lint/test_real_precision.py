"""The linter on real training code: its findings are exactly the labelled ones, 9 in 10 right.

``tests/lint/real/`` holds pinned copies (``<repo>/<path>.txt``, verbatim, licenses in
``labels.json``) of every file of pytorch/examples, nanoGPT, minGPT and timm's train.py and
validate.py that the linter flags, or once flagged wrongly. ``labels.json`` labels each
finding right or wrong after reading the code, and lists the former false alarms that must
stay silent. docs/lint.md's precision table is generated from the labels.
"""

from __future__ import annotations

import json
from collections import Counter

from helpers import ROOT, deep

from loopkit import lint

REAL = ROOT / "tests" / "lint" / "real"
LABELS = json.loads((REAL / "labels.json").read_text())
EVERY = list(lint.RULES)


def _findings() -> set[tuple[str, str, int, str]]:
    """(repo, path, line, code) of every finding, every rule on, over the pinned copies."""
    found = set()
    for copy in REAL.rglob("*.py.txt"):
        repo, path = copy.relative_to(REAL).parts[0], copy.relative_to(REAL).parts[1:]
        name = "/".join(path)[: -len(".txt")]
        for f in lint.check_source(copy.read_text(), name, select=EVERY):
            found.add((repo.replace("+", "/"), name, f.line, f.code))
    return found


def _key(label: dict[str, object]) -> tuple[str, str, int, str]:
    return (str(label["repo"]), str(label["path"]), int(label["line"]), str(label["code"]))  # type: ignore[call-overload]


@deep
def test_the_findings_on_real_code_are_exactly_the_labelled_ones() -> None:
    """Every finding is labelled and every labelled finding is still found; none of the
    former false alarms comes back."""
    found = _findings()
    assert found == {_key(label) for label in LABELS["findings"]}
    assert not found & {_key(label) for label in LABELS["silent"]}


def precision_table() -> str:
    """docs/lint.md's table: per rule, findings, right and precision, from the labels."""
    per_rule: Counter[str] = Counter()
    right: Counter[str] = Counter()
    for label in LABELS["findings"]:
        per_rule[label["code"]] += 1
        right[label["code"]] += bool(label["right"])
    rows = ["| rule | findings | right | precision |", "| --- | --- | --- | --- |"]
    for code in sorted(per_rule):
        rows.append(
            f"| {code} | {per_rule[code]} | {right[code]} | {right[code] / per_rule[code]:.0%} |"
        )
    total, good = sum(per_rule.values()), sum(right.values())
    rows.append(f"| all | {total} | {good} | {good / total:.0%} |")
    return "\n".join(rows) + "\n"


def test_precision_is_at_least_nine_in_ten_per_rule_and_overall() -> None:
    """Computed from the labels: each rule and all of them together right >= 90% of the time."""
    per_rule: dict[str, list[bool]] = {}
    for label in LABELS["findings"]:
        per_rule.setdefault(label["code"], []).append(bool(label["right"]))
    everything = [v for votes in per_rule.values() for v in votes]
    assert sum(everything) / len(everything) >= 0.9
    for code, votes in per_rule.items():
        assert sum(votes) / len(votes) >= 0.9, code


def test_the_docs_table_is_the_labels() -> None:
    """docs/lint.md shows the table this module computes, and the misses still known."""
    text = (ROOT / "docs" / "lint.md").read_text()
    assert precision_table() in text
    for miss in LABELS["known_misses"]:
        assert miss in text


def test_every_pinned_copy_is_a_source_with_a_label() -> None:
    """No copy is kept that no label points at (they are evidence, not fixtures)."""
    labelled = {(x["repo"], x["path"]) for x in LABELS["findings"] + LABELS["silent"]}
    copies = {
        (
            c.relative_to(REAL).parts[0].replace("+", "/"),
            "/".join(c.relative_to(REAL).parts[1:])[:-4],
        )
        for c in REAL.rglob("*.py.txt")
    }
    assert copies == labelled
    assert set(LABELS["sources"]) == {repo for repo, _ in labelled}
