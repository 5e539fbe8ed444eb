"""GuardedTrainer on the real HF Trainer: 3 gloo ranks posing as 3 nodes, a tiny GPT-2.

Skipped when transformers/accelerate are not installed, unless SLURM_GUARD_REQUIRE_INTEGRATIONS=1
(CI), where their absence fails. Each test spawns real processes (tests/hf_workers.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from slurm_guard.local import run_local

HAVE = all(importlib.util.find_spec(m) is not None for m in ("transformers", "accelerate"))
if not HAVE and os.environ.get("SLURM_GUARD_REQUIRE_INTEGRATIONS") == "1":
    raise RuntimeError("SLURM_GUARD_REQUIRE_INTEGRATIONS=1 but transformers/accelerate are missing")
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not HAVE, reason="needs the [hf] extra (transformers, accelerate)"),
]

NODES = ["node1", "node2", "node3"]


def _run(fn: Any, root: Path) -> list[Any]:
    outs = run_local(fn, 3, (str(root),), nodes=NODES, timeout=900)
    return outs


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import hf_workers

    root = tmp_path_factory.mktemp("hf")
    outs = _run(hf_workers.clean_and_nan, root)
    assert all(o.status == "ok" for o in outs), [o.value for o in outs]
    return {"root": root, "ranks": [o.value for o in outs]}


def test_clean_run_with_accumulation_raises_no_alarm_and_matches_the_plain_trainer(
    clean: dict[str, Any],
) -> None:
    ranks = clean["ranks"]
    shas = {r["clean"]["sha"] for r in ranks}
    assert len(shas) == 1 and ranks[0]["clean"]["global_step"] == 8
    # the Trainer logs the true pre-clip norm (the guard clipped), not 0: the plain Trainer's
    # up to the last bits (the guard's comm hook divides and sums in its own order)
    norms, plain = ranks[0]["clean"]["grad_norms"], ranks[0]["plain"]["grad_norms"]
    assert len(norms) == len(plain) == 8 and max(norms) > 1.0  # clipping had work to do
    assert norms == pytest.approx(plain, rel=1e-3)
    alarms = list((clean["root"] / "clean-run" / "alarms").glob("*.json"))
    assert alarms == []
    ledger = (clean["root"] / "clean-run" / "ledger.jsonl").read_text().splitlines()
    replays = [json.loads(x) for x in ledger if '"replay"' in x]
    assert [e["step"] for e in replays if e["passed"]] == [0, 3, 6]


def test_a_nan_sample_stops_as_numerical(clean: dict[str, Any]) -> None:
    alarms = [r["nan"] for r in clean["ranks"]]
    assert all(a is not None for a in alarms), alarms
    alarm = alarms[0]
    assert alarm["verdict"] == "numerical" and alarm["step"] <= 3
    assert alarm["suspect_nodes"] == []  # the data's fault: no node is drained
    assert alarm["evidence"]["nonfinite_ranks"] == [2]  # the rank that was served the NaN row


def test_persistent_fault_caught_on_its_node_and_resume_skips_later_checkpoints(
    clean: dict[str, Any], tmp_path: Path
) -> None:
    import hf_workers

    root = tmp_path
    outs = _run(hf_workers.faulty, root)
    assert all(o.status == "alarm" for o in outs), [o.value for o in outs]
    alarm = outs[0].value
    assert alarm["verdict"] == "sdc" and alarm["suspect_nodes"] == ["node3"]
    written = hf_workers.checkpoints(str(root / "fault-out"))
    assert "checkpoint-5" in written  # saved after the onset, before the replay caught it
    outs = _run(hf_workers.resumed, root)
    assert all(o.status == "ok" for o in outs), [o.value for o in outs]
    value = outs[0].value
    assert value["resumed_from"] == 3  # the newest checkpoint the replays vouch for
    left = [p for p in hf_workers.checkpoints(str(root / "fault-out")) if "quarantine" not in p]
    assert all(int(p.split("-")[1]) <= 8 for p in left)
    quarantined = (root / "fault-out" / "slurm-guard-quarantine" / alarm["alarm_id"]).iterdir()
    assert {p.name for p in quarantined} == {"checkpoint-4", "checkpoint-5", "checkpoint-6"}
    # bit-identical to the uninterrupted clean run
    assert value["sha"] == clean["ranks"][0]["clean"]["sha"]
