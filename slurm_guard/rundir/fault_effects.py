"""What each injected fault changed: `faults/<attempt>.json` in the run directory.

An injected fault that changes no value (a gradient scaled where it is exactly zero, a NaN
written over a NaN) raises no alarm, and a user who sees none concludes that the guard does not
work. So every rank counts the values its faults changed (on the device, read once when the
counts are recorded), rank 0 gathers the counts at every checkpoint save and at the end of the
run (`exit_on_alarm`), writes them here, and says so when a fault whose steps have passed
changed nothing. `slurm-guard status` and `report` read the newest record.

Torch-free: the admin side reads it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from slurm_guard.protocol import FAULT_EFFECTS_SCHEMA
from slurm_guard.rundir.records import RecordError, atomic_write_json, read_json_file

FAULTS_DIR = "faults"
NO_CHANGE = "changed no value"

_WHY = {
    "grad-scale": "the gradients it scaled were zero",
    "grad-bitflip": "the gradients it touched were unchanged",
    "nan": "the gradient values it set were NaN already",
    "inf": "the gradient values it set were +Inf already",
    "activation": "x*factor+factor equals x for every output it touched",
    "allreduce": "x*factor+factor equals x for every averaged value it touched",
    "gemm": "the GEMM outputs it scaled were zero",
    "replay-noise": "the replayed gradients it perturbed were zero",
}


def fault_entry(
    fault: dict[str, Any], rows: list[list[int]], index: int, nodes: list[str]
) -> dict[str, Any]:
    """One fault's effects from the gathered rows (rank r's row holds, for every fault in
    order, [values changed, first step, last step], -1 for a step where it never ran)."""
    by_rank = {r: row[3 * index] for r, row in enumerate(rows) if row[3 * index + 1] >= 0}
    firsts = [row[3 * index + 1] for row in rows if row[3 * index + 1] >= 0]
    lasts = [row[3 * index + 2] for row in rows if row[3 * index + 2] >= 0]
    ran = [min(firsts), max(lasts)] if firsts else None
    where = sorted({nodes[r] for r in by_rank}) if by_rank else []
    return {
        **fault,
        "changed": sum(by_rank.values()),
        "changed_by_rank": {str(r): n for r, n in sorted(by_rank.items())},
        "ran_steps": ran,
        "ran_on_nodes": where,
    }


def no_change_warning(entry: dict[str, Any], steps_done: int) -> str | None:
    """The warning for a fault whose onset has passed and that changed no value, else None."""
    if entry.get("changed") or int(entry.get("step", 0)) >= steps_done:
        return None
    ran = entry.get("ran_steps")
    target = entry.get("target", "?")
    if not ran:
        why = "it never ran: nothing it targets was computed on its target" + (
            " (the parameter got no gradient)" if entry.get("kind") in _GRAD_KINDS else ""
        )
        span = ""
    else:
        why = _WHY.get(str(entry.get("kind")), "every value it touched came out unchanged")
        if entry.get("factor") == 1.0 and entry.get("kind") in ("grad-scale", "gemm"):
            why = "factor=1 changes no value"
        first, last = ran
        span = f" (step {first})" if first == last else f" (steps {first}-{last})"
        target = ", ".join(entry.get("ran_on_nodes") or []) or target
    return f"slurm-guard: injected fault {entry.get('spec')} {NO_CHANGE} on {target}{span}: {why}"


_GRAD_KINDS = ("grad-scale", "grad-bitflip", "nan", "inf", "replay-noise")


def record(
    faults: list[dict[str, Any]],
    rows: list[list[int]],
    nodes: list[str],
    *,
    attempt: str,
    restart_count: int,
    job_id: str | None,
    steps_done: int,
    final: bool,
) -> dict[str, Any]:
    """The record rank 0 writes; `nodes[r]` is rank r's node."""
    entries = [fault_entry(f, rows, i, nodes) for i, f in enumerate(faults)]
    for entry in entries:
        entry["warning"] = no_change_warning(entry, steps_done)
    return {
        "schema": FAULT_EFFECTS_SCHEMA,
        "attempt": attempt,
        "restart_count": restart_count,
        "job_id": job_id,
        "steps_done": steps_done,
        "final": final,
        "written": time.time(),
        "faults": entries,
    }


def effects_path(run_dir: Path, attempt: str) -> Path:
    return run_dir / FAULTS_DIR / f"{attempt}.json"


def write(run_dir: Path, rec: dict[str, Any]) -> Path:
    """Atomically (temp file, fsync, rename); a later record of the same start replaces it."""
    path = effects_path(run_dir, str(rec["attempt"]))
    path.parent.mkdir(exist_ok=True)
    atomic_write_json(path, rec)
    return path


def read_newest(run_dir: Path) -> dict[str, Any] | None:
    """The newest start's record (by its `written` time), None when no start recorded one.

    Raises:
        RecordError: a record is unreadable, not an object, or of a newer schema.
    """
    folder = run_dir / FAULTS_DIR
    if not folder.is_dir():
        return None
    newest: dict[str, Any] | None = None
    for path in sorted(folder.glob("*.json")):
        obj = read_json_file(path)
        if not isinstance(obj, dict) or not isinstance(obj.get("faults"), list):
            raise RecordError(f"{path}: not a fault-effects record")
        schema = obj.get("schema")
        if not isinstance(schema, int) or schema > FAULT_EFFECTS_SCHEMA:
            raise RecordError(f"{path}: schema {schema!r} is not one this slurm-guard reads")
        if newest is None or float(obj.get("written", 0)) > float(newest.get("written", 0)):
            newest = obj
    return newest


def warnings_of(rec: dict[str, Any] | None) -> list[str]:
    """The `changed no value` warnings of a record (none for None)."""
    if rec is None:
        return []
    return [str(f["warning"]) for f in rec["faults"] if isinstance(f, dict) and f.get("warning")]
