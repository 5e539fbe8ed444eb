"""The alarm names the GPU: the suspect rank's CUDA index, UUID and PCI bus id travel from the
rank's start (run.json) into the alarm record, the drain reason and `slurm-guard review`.

On CPU (every test here) the fields are present and null and nothing shows a GPU; the drain
reason and review with a recorded GPU are checked on an alarm file that carries one, through
the real engine against DryRunSlurm. benchmarks/gpu_check.py checks the fields on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_cli_review import JOB, NO_SLURM, NODES, alarm, cluster

from slurm_guard.cli import main
from slurm_guard.comm.devices import node_gpu_index
from slurm_guard.comm.topology import _decode_gpu, _encode_gpu, local_rank_info
from slurm_guard.controller.engine import Engine
from slurm_guard.controller.policy import Policy, drain_reason
from slurm_guard.controller.state import StateStore
from slurm_guard.rundir.gpus import GpuIdentity
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import RecordError, parse_alarm

GPU5 = {
    "index": 0,
    "node_index": 5,
    "uuid": "GPU-6f1b2c3d-0000-1111-2222-333344445555",
    "pci_bus_id": "00000000:9B:00.0",
}


def test_a_cpu_rank_records_no_gpu_and_its_alarm_reason_names_none() -> None:
    assert local_rank_info(0).gpu is None
    assert _decode_gpu(_encode_gpu(None)) is None
    plain = alarm(suspect_gpus=(None,))
    back = parse_alarm(plain.to_json())
    assert back.suspect_gpus == (None,)
    assert "gpu" not in drain_reason(back)


def test_the_drain_reason_names_the_node_s_gpu_index() -> None:
    reason = drain_reason(alarm(suspect_gpus=(GPU5,)))
    assert reason.startswith("slurm-guard: job 100 step 340 check replay gpu 5 alarm ")
    assert reason.endswith(f"alarm job{JOB}-r0-step340-replay")  # still parsed back by review
    no_node_index = dict(GPU5, node_index=None)  # CUDA_VISIBLE_DEVICES listed UUIDs
    assert " gpu 0 alarm " in drain_reason(alarm(suspect_gpus=(no_node_index,)))


def test_the_gpu_fields_survive_the_rank_gather_encoding() -> None:
    gpu = GpuIdentity(**GPU5)
    assert _decode_gpu(_encode_gpu(gpu)) == gpu
    bare = GpuIdentity(2, None, None, None)
    assert _decode_gpu(_encode_gpu(bare)) == bare


@pytest.mark.parametrize(
    ("visible", "index", "expected"),
    [(None, 3, 3), ("4,5,6", 1, 5), ("GPU-aaaa,GPU-bbbb", 0, None), ("7", 2, None)],
)
def test_the_node_index_follows_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch, visible: str | None, index: int, expected: int | None
) -> None:
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert node_gpu_index(index) == expected


def test_old_alarms_without_gpus_stay_readable_and_odd_ones_are_refused() -> None:
    old = alarm().to_json()
    del old["suspect_gpus"]
    assert parse_alarm(old).suspect_gpus == ()
    for bad in ([GPU5, GPU5], [dict(GPU5, index="0")], [{"index": 0}], "gpu 5", [True]):
        with pytest.raises(RecordError, match="suspect_gpus"):
            parse_alarm(dict(old, suspect_gpus=bad))


def _handled(tmp_path: Path, gpus: tuple[dict[str, Any] | None, ...]) -> StateStore:
    run_dir = tmp_path / "run"
    RunDir(run_dir).ensure()
    RunDir(run_dir).write_alarm(alarm(suspect_gpus=gpus))
    store, slurm = StateStore(tmp_path / "state"), cluster()
    report = Engine(slurm, store, Policy()).process_job(JOB, run_dir, allocation=NODES)
    assert slurm.node("node2").drained, report.lines()
    return store


@pytest.mark.parametrize(("gpus", "shown"), [((GPU5,), "node2 gpu 5: alarm"), ((None,), None)])
def test_review_shows_the_gpu_index_when_the_alarm_recorded_one(
    tmp_path: Path, gpus: tuple[dict[str, Any] | None, ...], shown: str | None
) -> None:
    store = _handled(tmp_path, gpus)
    args = ["review", "--state-dir", str(store.root)]
    text = CliRunner().invoke(main, args, env=NO_SLURM)
    assert text.exit_code == 0, text.output
    view = json.loads(CliRunner().invoke(main, [*args, "--json"], env=NO_SLURM).output)
    (entry,) = view["nodes"][0]["alarms"]
    if shown is None:
        assert entry["gpu"] is None and " gpu " not in text.output
    else:
        assert shown in text.output and entry["gpu"] == "gpu 5"
        assert "check replay gpu 5 alarm" in view["nodes"][0]["reason"]


def test_the_report_names_the_suspect_gpu(tmp_path: Path) -> None:
    from slurm_guard.report import read_timeline
    from slurm_guard.report.html import render_page

    run_dir = tmp_path / "run"
    RunDir(run_dir).ensure()
    RunDir(run_dir).write_alarm(alarm(suspect_gpus=(GPU5,)))
    assert "node2 (ranks 1) gpu 5" in render_page(read_timeline(run_dir), None)
