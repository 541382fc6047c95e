"""What the GPU check's pytest runs found, from their JUnit XML reports: the CUDA tests of tests/
(one run; on a GPU a skip is a failure), and the rank tests of tests/gpu/ (one report per rank
of a launch; a check passes only where every rank passed it, a rank that never reported fails
it, and a peer's check (NCCL) is reported without failing the run)."""
from __future__ import annotations

import glob
import os
import re
import xml.etree.ElementTree as ElementTree

ORDER = ("passed", "skipped", "failed")  # a test reported more than once takes the worst


def testcases(path: str):
    """(classname, name, outcome, detail) of every test case of a pytest JUnit XML report."""
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag, meaning in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                lines = [line for line in (found.text or "").splitlines() if line.strip()]
                outcome, detail = meaning, found.get("message") or (lines[-1] if lines else tag)
                break
        yield case.get("classname", ""), case.get("name", ""), outcome, detail


def properties(path: str) -> dict:
    """The test suite's properties (pytest's record_testsuite_property)."""
    return {p.get("name"): p.get("value") for p in ElementTree.parse(path).getroot().iter("property")}


def read_junit(path: str) -> dict:
    """Counts of a pytest JUnit XML report, with the names of the tests that did not pass. A test
    reported more than once (pytest-isolate-mpi reports a multi-rank test once per rank, "[rank=N]",
    and once for the launch as a whole) failed if any entry failed, else
    skipped if any entry skipped."""
    outcomes = {}
    for classname, test, outcome, _ in testcases(path):
        name = classname + "::" + re.sub(r"\[rank=[0-9]+\]$", "", test)
        if ORDER.index(outcome) >= ORDER.index(outcomes.get(name, "passed")):
            outcomes[name] = outcome
    return {"tests": len(outcomes), "failed": [n for n, o in outcomes.items() if o == "failed"],
            "skipped": [n for n, o in outcomes.items() if o == "skipped"]}


def judge_tests(counts: dict, dry_run: bool, exit_code: int):
    """On a GPU every selected CUDA test must pass: a skip is a failure there. In a dry run they
    are all expected to skip, and nothing may fail."""
    tests, failed, skipped = counts["tests"], counts["failed"], counts["skipped"]
    if tests == 0:
        return "failed", "pytest collected no CUDA tests"
    if failed:
        return "failed", f"{len(failed)} of {tests} failed: {', '.join(failed[:10])}"
    if dry_run:
        if len(skipped) != tests:
            return "failed", f"{tests - len(skipped)} CUDA tests ran without a GPU (they should skip)"
        return "skipped", f"no GPU: the {tests} CUDA tests were collected and skipped"
    if skipped:
        return "failed", f"{len(skipped)} of {tests} CUDA tests skipped on a GPU: {', '.join(skipped[:10])}"
    if exit_code != 0:
        return "failed", f"pytest exited {exit_code} although every test passed"
    return "passed", f"{tests} CUDA tests passed"


def rank_checks(path: str) -> dict:
    """{check: (ok, detail)} of one rank's report, in its order; a check is "module::test". A
    skipped test is no pass: the launch deselects what it does not ask for, so nothing skips."""
    checks = {}
    for classname, test, outcome, detail in testcases(path):
        name, ok = f"{classname.rsplit('.', 1)[-1]}::{test}", outcome == "passed"
        if name not in checks or (checks[name][0] and not ok):  # a test reported twice keeps its failure
            checks[name] = (ok, f"skipped: {detail}" if outcome == "skipped" else detail)
    return checks


def merge_ranks(folder: str, ranks: int, exit_code: int) -> dict:
    """One launch's checks from its ranks' reports (DIR/rank<r>.xml): a check passes only where
    every rank passed it; a rank that wrote no report (or one cut short), or a check some rank
    never reached, fails."""
    reports, facts = {}, {}
    for path in glob.glob(os.path.join(folder, "rank*.xml")):
        rank = int(re.search(r"rank([0-9]+)\.xml$", path).group(1))
        try:
            reports[rank], facts[rank] = rank_checks(path), properties(path)
        except ElementTree.ParseError:
            continue  # written by two processes at once, or cut off: as good as none
    checks = {}
    for rank in sorted(reports):
        for name, (ok, detail) in reports[rank].items():
            merged = checks.setdefault(name, {"name": name, "ok": True, "detail": "", "ranks": []})
            merged["ranks"].append(rank)
            if not ok and merged["ok"]:
                merged["ok"], merged["detail"] = False, f"rank {rank}: {detail}"
    for merged in checks.values():
        absent = [r for r in range(ranks) if r not in merged["ranks"]]
        if absent and merged["ok"]:
            merged["ok"], merged["detail"] = False, f"ranks {absent} did not report it (the launch died: see gpu-check.log)"
    problem = ""
    if len(reports) != ranks:
        problem = f"{len(reports)} of {ranks} ranks wrote results"
    elif exit_code != 0:
        problem = f"the launch exited {exit_code}"
    any_rank = facts[min(facts)] if facts else {}
    return {"checks": list(checks.values()), "problem": problem, "exit_code": exit_code,
            "mpi_library": any_rank.get("mpi_library"), "cuda_aware": any_rank.get("cuda_aware"),
            "nccl_version": any_rank.get("nccl_version")}


def is_peer(check: dict) -> bool:
    """A check of a peer (NCCL, tests/gpu/test_device_peer_nccl.py), not of mpidist: recorded,
    never failing the run."""
    return check["name"].split("::")[-1].startswith("test_peer_")


def passed_on_every_rank(checks: list) -> str:
    """How many of a launch's checks passed on every rank, of all; a peer's failed checks (which
    do not fail the run) named, since they are not among the passed."""
    passed = [c for c in checks if c["ok"]]
    peers = [c["name"] for c in checks if not c["ok"] and is_peer(c)]
    return f"{len(passed)} of {len(checks)} checks passed on every rank" + (
        f"; {len(peers)} checks of a peer failed (not failing the run): {', '.join(peers)}" if peers else "")


def nccl_outcome(checks) -> str:
    """Whether NCCL ran in a launch, from its test_peer_nccl_runs checks (one per kind of array)."""
    runs = [c for c in checks if c["name"].split("::")[-1].startswith("test_peer_nccl_runs")]
    if not runs:
        return "not tried"
    refused = [c for c in runs if not c["ok"]]
    return f"did not run: {' '.join(refused[0]['detail'][:300].split())}" if refused else "ran"
