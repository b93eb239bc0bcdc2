"""The scanners a user runs on template.yaml find nothing unexplained: checkov
and cfn-lint with the serverless rules (cfn-lint-serverless). A finding that
does not apply is suppressed in the resource's Metadata with its reason
(checkov: ``skip: [{id, comment}]``; cfn-lint: ``ignore_checks``, one rule
per line with a ``#`` comment), so that a user's own run of either scanner
agrees with this one.

Each scanner runs once per session, on the real template and on a broken
copy (the feedback topic's encryption and one suppression taken out), whose
faults each must report: a scanner that silently checked nothing fails here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cfnlint.decode import cfn_yaml

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "template.yaml"
# checkov lives in a venv of its own (it pins boto3 and packaging): `make test` installs it.
CHECKOV = ROOT / ".tools" / "checkov" / "bin" / "checkov"
CFN_LINT = Path(sys.executable).parent / "cfn-lint"
ENCRYPTION = "      KmsMasterKeyId: !Ref SesFeedbackTopicKey\n"
SUPPRESSION = re.compile(r"(\n\s+ignore_checks:)\n\s+- ES6000 [^\n]*")


def run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


@pytest.fixture(scope="session")
def templates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the real template and ``broken.yaml``: the same without
    the feedback topic's KmsMasterKeyId, and without the first queue's
    suppression of cfn-lint's ES6000."""
    folder = tmp_path_factory.mktemp("scan")
    shutil.copy(TEMPLATE, folder / "template.yaml")
    text = TEMPLATE.read_text()
    assert text.count(ENCRYPTION) == 1
    broken, suppressions_removed = SUPPRESSION.subn(r"\1 []", text.replace(ENCRYPTION, ""), 1)
    assert suppressions_removed == 1
    (folder / "broken.yaml").write_text(broken)
    return folder


@pytest.fixture(scope="session")
def checkov_findings(templates: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """File name -> {"failed": [...], "skipped": [...]}, from one checkov run."""
    if not CHECKOV.exists():
        pytest.fail(f"no checkov at {CHECKOV.relative_to(ROOT)}: run `make test` (or make pytest)")
    out = run(
        CHECKOV,
        "--directory",
        templates,
        "--framework",
        "cloudformation",
        "--output",
        "json",
        "--compact",
        "--skip-download",  # offline: no policy metadata from the vendor's API
        cwd=templates,
    )
    assert out.returncode in (0, 1), out.stderr[-3000:]
    report = json.loads(out.stdout)
    findings: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for result in ("failed", "skipped"):
        for check in report["results"][f"{result}_checks"]:
            name = Path(check["file_path"]).name
            findings.setdefault(name, {"failed": [], "skipped": []})[result].append(check)
    assert report["summary"]["parsing_errors"] == 0
    return findings


@pytest.fixture(scope="session")
def cfn_lint_findings(templates: Path) -> dict[str, list[str]]:
    """File name -> "RULE resource message" lines, from one cfn-lint run with the serverless rules."""
    out = run(
        CFN_LINT,
        "--append-rules",
        "cfn_lint_serverless.rules",
        # informational rules too: I3011 (a stateful resource without an
        # explicit DeletionPolicy and UpdateReplacePolicy) is one of them
        "--include-checks",
        "I",
        "--format",
        "json",
        "--",
        "template.yaml",
        "broken.yaml",
        cwd=templates,
    )
    try:
        matches = json.loads(out.stdout)
    except ValueError:
        pytest.fail(f"cfn-lint did not answer in JSON: {out.stdout[-2000:]} {out.stderr[-2000:]}")
    findings: dict[str, list[str]] = {"template.yaml": [], "broken.yaml": []}
    for match in matches:
        findings[Path(match["Filename"]).name].append(f"{match['Rule']['Id']} {match['Message']}")
    return findings


def test_checkov_finds_nothing_unexplained(
    checkov_findings: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:
    found = checkov_findings.get("template.yaml", {"failed": [], "skipped": []})
    assert [(c["check_id"], c["resource"]) for c in found["failed"]] == []
    # Every suppression that took effect says why.
    unexplained = [
        (c["check_id"], c["resource"])
        for c in found["skipped"]
        if len(c["check_result"].get("suppress_comment", "").split()) < 5
    ]
    assert unexplained == []


def test_checkov_reports_an_unencrypted_feedback_topic(
    checkov_findings: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:
    failed = checkov_findings["broken.yaml"]["failed"]
    assert [(c["check_id"], c["resource"]) for c in failed] == [
        ("CKV_AWS_26", "AWS::SNS::Topic.SesFeedbackTopic")
    ]


def test_cfn_lint_with_the_serverless_rules_finds_nothing(
    cfn_lint_findings: dict[str, list[str]],
) -> None:
    assert cfn_lint_findings["template.yaml"] == []


def test_cfn_lint_reports_what_a_suppression_no_longer_hides(
    cfn_lint_findings: dict[str, list[str]],
) -> None:
    assert cfn_lint_findings["broken.yaml"] == [
        "ES6000 SQS Queue FailureQueue should have a RedrivePolicy property configured."
    ]


# --- the suppressions themselves ------------------------------------------------


def suppressions_without_reason(template_text: str) -> list[str]:
    """Each checkov skip without a comment, and each cfn-lint ignored rule
    whose line has no ``#`` reason, as "Resource: rule"."""
    template = cfn_yaml.loads(template_text)
    lines = template_text.splitlines()
    missing = []
    for name, resource in template["Resources"].items():
        metadata = resource.get("Metadata") or {}
        for skip in (metadata.get("checkov") or {}).get("skip", []):
            if len(str(skip.get("comment", "")).split()) < 5:
                missing.append(f"{name}: {skip.get('id')}")
        ignored = ((metadata.get("cfn-lint") or {}).get("config") or {}).get("ignore_checks", [])
        for rule in ignored:
            line = lines[rule.start_mark.line]  # cfn-lint's nodes know their line
            reason = line.partition("#")[2]
            if not re.fullmatch(rf"\s*- {re.escape(str(rule))}\s*", line.partition("#")[0]) or (
                len(reason.split()) < 5
            ):
                missing.append(f"{name}: {rule}")
    return missing


def test_every_suppression_in_the_template_says_why() -> None:
    text = TEMPLATE.read_text()
    assert "checkov:" in text and "ignore_checks:" in text
    assert suppressions_without_reason(text) == []


def test_a_suppression_without_its_reason_is_reported() -> None:
    text = TEMPLATE.read_text()
    no_comment = re.sub(r"(\n\s+- id: CKV_AWS_27)\n\s+comment: [^\n]+", r"\1", text, count=1)
    no_reason = re.sub(r"(- ES6000)\s*#[^\n]*", r"\1", text, count=1)
    assert suppressions_without_reason(no_comment) == ["FailureQueue: CKV_AWS_27"]
    assert suppressions_without_reason(no_reason) == ["FailureQueue: ES6000"]
