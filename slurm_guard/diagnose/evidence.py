"""Node evidence in the controller's state directory: burn-in diagnoses and golden results.

`slurm-guard diagnose` runs on a node (it needs torch and the node's devices); `review` and
`review return` run on the admin host (the controller never imports torch). Both sides read and
write the same records, so the format and the file layout live here, in a standard-library
module, the way `protocol.py` holds the constants both sides share.

Layout under the state directory:

    diagnoses/<node>/<time>-<pid>.json        one record per diagnose run, written once
    golden/<device key hash>/<case>.json      the first passing node's digest of each case

A golden result is written once (link(), which fails if the name exists), so two nodes passing
at the same moment cannot overwrite each other, and a later node can never replace it: a node
whose results differ from the golden one fails, it does not redefine "right".
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_guard.rundir.records import (
    RecordError,
    atomic_write_json,
    check_field_types,
    read_json_file,
)

DIAGNOSIS_SCHEMA = 1
DIAGNOSES_DIR = "diagnoses"
GOLDEN_DIR = "golden"

# Golden comparison outcomes, per case and for the whole run.
GOLDEN_MATCH = "match"  # equal to the digest the first passing node recorded
GOLDEN_MISMATCH = "mismatch"  # differs from it: the node fails
GOLDEN_RECORDED = "recorded"  # no golden digest yet; this passing run became it
GOLDEN_NOT_CHECKED = "not checked"  # not compared (no state dir, or the run failed first)
GOLDEN_STATES = (GOLDEN_MATCH, GOLDEN_MISMATCH, GOLDEN_RECORDED, GOLDEN_NOT_CHECKED)

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def safe_name(name: str, what: str) -> str:
    """A node or case name that is safe as a single path component."""
    if not _SAFE_NAME.match(name):
        raise RecordError(
            f"{what} {name!r} cannot name a file: use letters, digits, '.', '_' and '-' only"
        )
    return name


@dataclass(frozen=True)
class CaseResult:
    """One known-answer GEMM on one device: its digest, repeats and checks."""

    case: str  # precision/size/seed, the golden key within a device key, e.g. "fp32-n512-s0"
    device_index: int  # which GPU (0 on CPU)
    precision: str
    size: int
    seed: int
    digest: str  # sha256 of the first result's bytes
    repeats: int  # recomputations compared with the first result
    mismatches: int  # repeats that were not bit-identical to the first result
    first_mismatch: dict[str, Any] | None  # where and by how much the first one differed
    checksum_ok: bool  # column sums agree with (1^T A) B within a rounding bound
    checksum_excess: float  # worst |error| / bound over the columns (<= 1 passes)
    golden: str = GOLDEN_NOT_CHECKED

    @property
    def passed(self) -> bool:
        return self.mismatches == 0 and self.checksum_ok and self.golden != GOLDEN_MISMATCH


@dataclass(frozen=True)
class Diagnosis:
    """One `slurm-guard diagnose` run on one node: the evidence `review` shows for that node."""

    node: str
    hostname: str
    device: dict[str, Any]  # kind, model, driver, torch, count, threads, ...
    device_key: str  # what the golden results are keyed by (model, driver, torch, ...)
    cases: tuple[CaseResult, ...]
    errors: tuple[str, ...]  # an exception from the device counts as a failure
    faults: tuple[str, ...]  # injected faults (SLURM_GUARD_INJECT kind=diagnose-gemm)
    started: float
    finished: float
    golden: str = GOLDEN_NOT_CHECKED
    schema: int = DIAGNOSIS_SCHEMA
    golden_from: dict[str, Any] = field(default_factory=dict)  # node/time of the golden record

    @property
    def passed(self) -> bool:
        return bool(self.cases) and not self.errors and all(c.passed for c in self.cases)

    def failures(self) -> list[str]:
        """One line per problem, in words an admin can act on."""
        out = list(self.errors)
        if not self.cases and not self.errors:
            out.append("no GEMM was run")
        for c in self.cases:
            where = f"device {c.device_index} {c.case}"
            if c.mismatches:
                out.append(
                    f"{where}: {c.mismatches} of {c.repeats} repeats differ from the first "
                    f"result (same inputs, same device): {c.first_mismatch}"
                )
            if not c.checksum_ok:
                out.append(
                    f"{where}: column sums off by {c.checksum_excess:.3g}x the rounding bound"
                )
            if c.golden == GOLDEN_MISMATCH:
                out.append(f"{where}: result differs from the golden result{self._golden_source()}")
        return out

    def _golden_source(self) -> str:
        node, when = self.golden_from.get("node"), self.golden_from.get("time")
        if not node:
            return ""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(when or 0)))
        return f" recorded by {node} at {stamp}"

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["cases"] = [dataclasses.asdict(c) for c in self.cases]
        d["errors"] = list(self.errors)
        d["faults"] = list(self.faults)
        d["passed"] = self.passed
        d["failures"] = self.failures()
        return d


_CASE_FIELDS: dict[str, tuple[type, ...]] = {
    "case": (str,),
    "device_index": (int,),
    "precision": (str,),
    "size": (int,),
    "seed": (int,),
    "digest": (str,),
    "repeats": (int,),
    "mismatches": (int,),
    "first_mismatch": (dict, type(None)),
    "checksum_ok": (bool,),
    "checksum_excess": (int, float),
    "golden": (str,),
}
_DIAGNOSIS_FIELDS: dict[str, tuple[type, ...]] = {
    "node": (str,),
    "hostname": (str,),
    "device": (dict,),
    "device_key": (str,),
    "cases": (list,),
    "errors": (list,),
    "faults": (list,),
    "started": (int, float),
    "finished": (int, float),
    "golden": (str,),
    "schema": (int,),
    "golden_from": (dict,),
}


def _check_fields(obj: Any, spec: dict[str, tuple[type, ...]], source: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise RecordError(f"{source}: expected a JSON object")
    check_field_types(obj, spec, source)
    return {k: obj[k] for k in spec}


def parse_diagnosis(obj: Any, source: str = "diagnosis") -> Diagnosis:
    """Validate a decoded diagnosis record (it may come from a node over ssh)."""
    if isinstance(obj, dict):
        schema = obj.get("schema")
        if isinstance(schema, int) and schema > DIAGNOSIS_SCHEMA:
            raise RecordError(
                f"{source}: diagnosis schema {schema} is newer than this slurm-guard understands "
                f"({DIAGNOSIS_SCHEMA}); upgrade slurm-guard here"
            )
    values = _check_fields(obj, _DIAGNOSIS_FIELDS, source)
    safe_name(values["node"], f"{source}: node")
    cases = []
    for i, raw in enumerate(values["cases"]):
        c = _check_fields(raw, _CASE_FIELDS, f"{source}: case {i}")
        if c["golden"] not in GOLDEN_STATES:
            raise RecordError(f"{source}: case {i}: unknown golden state {c['golden']!r}")
        safe_name(c["case"], f"{source}: case")
        c["checksum_excess"] = float(c["checksum_excess"])
        cases.append(CaseResult(**c))
    if values["golden"] not in GOLDEN_STATES:
        raise RecordError(f"{source}: unknown golden state {values['golden']!r}")
    values["cases"] = tuple(cases)
    values["errors"] = tuple(str(e) for e in values["errors"])
    values["faults"] = tuple(str(f) for f in values["faults"])
    values["started"] = float(values["started"])
    values["finished"] = float(values["finished"])
    return Diagnosis(**values)


# ------------------------------------------------------------------ the state directory


def diagnoses_dir(state_dir: Path, node: str | None = None) -> Path:
    root = Path(state_dir) / DIAGNOSES_DIR
    return root if node is None else root / safe_name(node, "node")


def record_diagnosis(state_dir: Path, diagnosis: Diagnosis) -> Path:
    """Keep a diagnosis as evidence for its node: a new file, written atomically, never replaced."""
    directory = diagnoses_dir(state_dir, diagnosis.node)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(diagnosis.finished))
    micros = int((diagnosis.finished % 1) * 1e6)
    path = directory / f"{stamp}.{micros:06d}-{os.getpid()}.json"
    atomic_write_json(path, diagnosis.to_json(), overwrite=False)
    return path


def read_diagnoses(state_dir: Path, node: str) -> list[Diagnosis]:
    """A node's diagnoses, oldest first. Unreadable records are skipped, not fatal: see `bad`."""
    good, _bad = read_diagnoses_checked(state_dir, node)
    return good


def read_diagnoses_checked(state_dir: Path, node: str) -> tuple[list[Diagnosis], list[str]]:
    """A node's diagnoses, oldest first, and one message per record that could not be read."""
    try:
        directory = diagnoses_dir(state_dir, node)
    except RecordError:
        return [], []
    out: list[Diagnosis] = []
    bad: list[str] = []
    if not directory.is_dir():
        return out, bad
    for path in sorted(directory.glob("*.json")):
        try:
            out.append(parse_diagnosis(read_json_file(path), str(path)))
        except RecordError as exc:
            bad.append(str(exc))
    out.sort(key=lambda d: d.finished)
    return out, bad


def latest_diagnosis(state_dir: Path, node: str) -> Diagnosis | None:
    found = read_diagnoses(state_dir, node)
    return found[-1] if found else None


def diagnosed_nodes(state_dir: Path) -> list[str]:
    root = diagnoses_dir(state_dir)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and _SAFE_NAME.match(p.name))


def _golden_dir(state_dir: Path, device_key: str) -> Path:
    digest = hashlib.sha256(device_key.encode()).hexdigest()[:24]
    return Path(state_dir) / GOLDEN_DIR / digest


def read_golden(state_dir: Path, device_key: str, case: str) -> dict[str, Any] | None:
    path = _golden_dir(state_dir, device_key) / f"{safe_name(case, 'case')}.json"
    if not path.exists():
        return None
    obj = read_json_file(path)
    if not isinstance(obj, dict) or obj.get("device_key") != device_key:
        raise RecordError(
            f"{path}: not a golden record for {device_key!r}; move it aside and rerun "
            "`slurm-guard diagnose` on a node you trust"
        )
    return obj


def judge_against_golden(state_dir: Path, diagnosis: Diagnosis) -> Diagnosis:
    """Compare each case with its device key's golden digest; a passing run records missing ones.

    Only a run that passed on its own (repeatable, checksums within bound, no error) and matches
    every golden digest that exists may record new ones, so a node that is wrong cannot define
    the answer for the nodes after it.
    """
    cases: list[CaseResult] = []
    sources: dict[str, Any] = {}
    for c in diagnosis.cases:
        golden = read_golden(state_dir, diagnosis.device_key, c.case)
        if golden is None:
            cases.append(c)
            continue
        sources.setdefault(c.case, {"node": golden.get("node"), "time": golden.get("time")})
        state = GOLDEN_MATCH if golden.get("digest") == c.digest else GOLDEN_MISMATCH
        cases.append(dataclasses.replace(c, golden=state))
    judged = dataclasses.replace(diagnosis, cases=tuple(cases))
    may_record = judged.passed
    final: list[CaseResult] = []
    for c in cases:
        if c.golden != GOLDEN_NOT_CHECKED or not may_record:
            final.append(c)
            continue
        path = _golden_dir(state_dir, diagnosis.device_key) / f"{c.case}.json"
        record = {
            "schema": DIAGNOSIS_SCHEMA,
            "device_key": diagnosis.device_key,
            "case": c.case,
            "digest": c.digest,
            "node": diagnosis.node,
            "time": diagnosis.finished,
        }
        try:
            atomic_write_json(path, record, overwrite=False)
            final.append(dataclasses.replace(c, golden=GOLDEN_RECORDED))
        except FileExistsError:  # another node recorded it a moment ago: compare with that one
            golden = read_golden(state_dir, diagnosis.device_key, c.case) or {}
            sources.setdefault(c.case, {"node": golden.get("node"), "time": golden.get("time")})
            state = GOLDEN_MATCH if golden.get("digest") == c.digest else GOLDEN_MISMATCH
            final.append(dataclasses.replace(c, golden=state))
    states = {c.golden for c in final}
    if GOLDEN_MISMATCH in states:
        overall = GOLDEN_MISMATCH
    elif states == {GOLDEN_MATCH}:
        overall = GOLDEN_MATCH
    elif GOLDEN_RECORDED in states:
        overall = GOLDEN_RECORDED
    else:
        overall = GOLDEN_NOT_CHECKED if GOLDEN_MATCH not in states else GOLDEN_MATCH
    first_source: dict[str, Any] = next(iter(sources.values()), {})
    return dataclasses.replace(judged, cases=tuple(final), golden=overall, golden_from=first_source)
