"""Injected faults say what they changed: a fault that changed no value warns (issue 43)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from effects_workers import zero_gradient_faults

import slurm_guard as sg
from slurm_guard.cli.main import main
from slurm_guard.faults.injection import parse_faults
from slurm_guard.local.launch import run_local
from slurm_guard.rundir import fault_effects

NODES = ["node1", "node2", "node3"]


def test_a_fault_spec_reads_back_as_the_same_fault() -> None:
    for text in (
        "kind=grad-scale,node=node2,step=27,persistent=1",
        "kind=gemm,rank=1,step=3,bit=30,layer=2,pass=grad_w,flip=1",
        "kind=activation,rank=0,step=0,element=7,factor=0.5",
    ):
        (fault,) = parse_faults(text)
        assert fault.spec() == text
        assert parse_faults(fault.spec()) == (fault,)


@pytest.mark.distributed
def test_a_fault_on_zero_gradients_warns_that_it_changed_no_value(tmp_path: Path) -> None:
    """The README's grad-scale fault on multinode.py's loss (gradients exactly zero) changed
    nothing and raised no alarm: rank 0 says so at the end, naming the spec; an activation
    fault in the same run changed values (no warning), and status shows the warning."""
    faults = (
        sg.Fault("grad-scale", node="node2", step=2, persistent=True),
        sg.Fault("activation", rank=2, step=3),
    )
    out = run_local(zero_gradient_faults, 3, args=(str(tmp_path), 6, faults), nodes=NODES)
    assert [o.status for o in out] == ["ok"] * 3, [o.value for o in out]
    warning = (
        "slurm-guard: injected fault kind=grad-scale,node=node2,step=2,persistent=1 changed no "
        "value on node2 (steps 2-5): the gradients it scaled were zero"
    )
    assert out[0].value["logged"].count(warning) == 1
    assert not any("changed no value" in m for o in out[1:] for m in o.value["logged"])
    record = out[0].value["record"]
    scale, activation = record["faults"]
    assert record["final"] and record["steps_done"] == 6
    assert (scale["changed"], scale["warning"]) == (0, warning)
    # the one-off activation fault changed one output element of rank 2's step 3, and only that
    assert (activation["changed"], activation["changed_by_rank"]) == (1, {"2": 1})
    assert activation["ran_steps"] == [3, 3] and activation["warning"] is None
    assert fault_effects.warnings_of(fault_effects.read_newest(tmp_path)) == [warning]
    status = CliRunner().invoke(
        main,
        ["status", str(tmp_path), "--state-dir", str(tmp_path / "state")],
        env={"SLURM_CONF": "/nonexistent/slurm.conf"},
    )
    assert warning.removeprefix("slurm-guard: injected fault ") in status.output, status.output
    report = CliRunner().invoke(main, ["report", str(tmp_path), "-o", str(tmp_path / "r.html")])
    assert report.exit_code == 0, report.output
    assert "changed no value on node2" in (tmp_path / "r.html").read_text()
