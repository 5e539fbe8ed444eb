"""Launch without Slurm: Slurm environment -> rank, rendezvous, port, and the sbatch template."""

from __future__ import annotations

import json
import os
import re
import subprocess
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from slurm_guard.local.launch import free_port
from slurm_guard.slurm.launch import check_run_dir, recovery_lines, render_sbatch
from slurm_guard.slurm.parsers import (
    NodeInfo,
    SlurmParseError,
    expand_hostlist,
    parse_tasks_per_node,
)
from slurm_guard.slurm.task import (
    ADDR_ENV,
    PORT_BASE,
    PORT_ENV,
    PORT_SPAN,
    RUN_DIR_ENV,
    LaunchError,
    init_distributed_from_slurm,
    port_for_job,
    rendezvous_address,
    rendezvous_file,
    step_rendezvous_address,
    task_from_env,
    torchrun_environment,
)

DATA = Path(__file__).resolve().parent / "data"
WEIRD_RUN_DIR = "/shared/we$ird;(run)&%x"

TASK_ENV = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "6",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NODELIST": "gpu-[07-09]",
    "SLURM_JOB_NODELIST": "gpu-[01-09]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
    "SLURM_TASKS_PER_NODE": "1(x9)",
    "SLURM_JOB_ID": "4242",
    "SLURM_RESTART_COUNT": "2",
    "SLURMD_NODENAME": "gpu-08",
}


class FakeClient:
    """Answers `node()` only; records what was asked."""

    def __init__(self, addresses: dict[str, str]) -> None:
        self.addresses = addresses
        self.asked: list[str] = []

    def node(self, name: str) -> NodeInfo:
        self.asked.append(name)
        return NodeInfo(name, frozenset({"ALLOCATED"}), None, None, self.addresses[name], name)


def test_task_comes_from_the_step_environment() -> None:
    task = task_from_env(TASK_ENV)
    assert (task.rank, task.world_size, task.local_rank, task.node_rank) == (3, 6, 1, 1)
    assert task.nodes == ("gpu-07", "gpu-08", "gpu-09")  # the step's nodes, not the job's
    assert task.first_node == "gpu-07"
    assert (task.job_id, task.restart_count, task.node) == ("4242", 2, "gpu-08")


def test_tasks_per_node_expands_as_slurm_writes_it() -> None:
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    assert parse_tasks_per_node("1,3(x2)") == [1, 3, 3]
    for bad in ("", "2(3)", "x", "2(x3"):
        with pytest.raises(SlurmParseError):
            parse_tasks_per_node(bad)


def test_local_world_size_is_the_steps_count_on_this_node() -> None:
    assert task_from_env(TASK_ENV).local_world_size == 2  # the step's "2(x3)", not the job's
    job_only = {k: v for k, v in TASK_ENV.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
    assert task_from_env({**job_only, "SLURM_TASKS_PER_NODE": "1,4,1"}).local_world_size == 4
    with pytest.raises(LaunchError, match=r"SLURM_LOCALID=1 outside 0\.\.0"):
        task_from_env(job_only)  # one task a node, yet this is local rank 1
    with pytest.raises(LaunchError, match="srun"):
        task_from_env({k: v for k, v in job_only.items() if k != "SLURM_TASKS_PER_NODE"})
    with pytest.raises(LaunchError, match="SLURM_NODEID=1 outside"):
        task_from_env({**TASK_ENV, "SLURM_STEP_TASKS_PER_NODE": "2"})


def test_the_environment_is_torchruns_for_frameworks() -> None:
    """What torchrun --nnodes 3 --nproc-per-node 2 gives the second worker of the second node,
    so Accelerate, Lightning and HF see the same under srun; never an elastic agent's ids."""
    env = torchrun_environment(task_from_env(TASK_ENV), "10.1.2.7", 29411)
    assert env == {
        "RANK": "3",
        "WORLD_SIZE": "6",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "3",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "6",
        "ROLE_NAME": "default",
        "MASTER_ADDR": "10.1.2.7",
        "MASTER_PORT": "29411",
    }
    assert not any(k.startswith("TORCHELASTIC") for k in env)


def test_first_run_has_restart_count_zero() -> None:
    env = {k: v for k, v in TASK_ENV.items() if k != "SLURM_RESTART_COUNT"}
    assert task_from_env(env).restart_count == 0


def test_outside_slurm_the_error_says_to_use_srun() -> None:
    with pytest.raises(LaunchError, match="srun"):
        task_from_env({})
    with pytest.raises(LaunchError, match="SLURM_PROCID=7"):
        task_from_env({**TASK_ENV, "SLURM_PROCID": "7"})


def test_port_is_per_job_and_per_restart_and_in_range() -> None:
    ports = {port_for_job(str(j), r) for j in range(1, 200) for r in range(3)}
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert port_for_job("4242") == port_for_job("4242")
    assert port_for_job("4242", 1) != port_for_job("4242", 0)
    assert port_for_job("4242") != port_for_job("4243")


def test_rendezvous_is_the_node_addr_never_the_node_name() -> None:
    client = FakeClient({"gpu-07": "10.1.2.7"})
    assert rendezvous_address("gpu-07", client) == "10.1.2.7"  # type: ignore[arg-type]
    assert client.asked == ["gpu-07"]


def test_init_joins_a_gloo_group_from_slurm_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        **TASK_ENV,
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_NODEID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "node-that-does-not-resolve",
        "SLURM_STEP_TASKS_PER_NODE": "1",
        "SLURMD_NODENAME": "node-that-does-not-resolve",
        PORT_ENV: str(free_port()),
    }
    port = env[PORT_ENV]
    task = task_from_env(env)
    for key in torchrun_environment(task, "", 0):
        monkeypatch.delenv(key, raising=False)
    client = FakeClient({"node-that-does-not-resolve": "127.0.0.1"})
    try:
        task = init_distributed_from_slurm(client, env)  # type: ignore[arg-type]
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        assert task.node == "node-that-does-not-resolve"
        exported = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")}
        assert exported == {"LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0", "MASTER_PORT": port}
        # never the overrides: they would pin the port of every job this process submits
        assert PORT_ENV not in os.environ and ADDR_ENV not in os.environ
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("runs/x", "relative"),
        ("/a b", "' '"),
        ("/a,b", "','"),
        ("/a/../b", "'..'"),
        ("/a'b", '"\'"'),
    ],
)
def test_run_dir_the_comment_cannot_carry_is_refused(path: str, problem: str) -> None:
    with pytest.raises(LaunchError, match=problem):
        check_run_dir(path)


def golden_render(**kw: Any) -> str:
    return render_sbatch(
        run_dir=WEIRD_RUN_DIR,
        nodes=3,
        gpus_per_node=8,
        train_command=["/opt/venv/bin/python", "train.py", "--name", "it's $HOME"],
        job_name="golden",
        state_dir="/var/lib/slurm guard",
        slurm_guard="/opt/venv/bin/slurm-guard",
        sbatch_options={"partition": "gpu", "exclusive": True},
        **kw,
    )


def test_template_renders_the_golden_file_with_a_weird_path() -> None:
    assert golden_render() == (DATA / "guarded_ddp.golden.sbatch").read_text()


def test_rendered_script_is_valid_bash_and_quotes_the_weird_path(tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(golden_render())
    subprocess.run(["bash", "-n", str(script)], check=True)
    # Run the part before srun: the variables must hold the exact strings, nothing executed.
    head = script.read_text().split("srun ")[0]
    out = subprocess.run(
        ["bash", "-c", head + 'printf "%s\\n%s\\n" "$SLURM_GUARD_RUN_DIR" "$STATE_DIR"'],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    ).stdout
    assert out.splitlines() == [WEIRD_RUN_DIR, "/var/lib/slurm guard"]


def test_cpu_job_asks_for_no_gpus_and_one_task_per_node() -> None:
    text = render_sbatch(run_dir="/shared/run", nodes=3)
    assert "--gpus-per-node" not in text
    assert "#SBATCH --ntasks-per-node=1\n" in text
    assert "#SBATCH --requeue\n" in text
    assert "#SBATCH --comment=slurm-guard:run_dir=/shared/run\n" in text
    assert not re.search(r"@[A-Z_]+@", text)


def test_a_total_task_count_is_asked_for_without_tasks_per_node() -> None:
    # Slurm 24.11 turns --ntasks=4 --ntasks-per-node=2 on 3 nodes into 6 tasks when the
    # controller sets the requeued job's ExcNodeList; --ntasks alone keeps 4.
    text = render_sbatch(run_dir="/shared/run", nodes=3, tasks=4)
    sbatch_lines = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --ntasks=4" in sbatch_lines
    assert not any("ntasks-per-node" in line for line in sbatch_lines)
    assert not re.search(r"@[A-Z_]+@", text)
    with pytest.raises(LaunchError, match="not both"):
        render_sbatch(run_dir="/shared/run", nodes=3, tasks=4, tasks_per_node=2)
    with pytest.raises(LaunchError, match="every node needs a task"):
        render_sbatch(run_dir="/shared/run", nodes=3, tasks=2)
    with pytest.raises(LaunchError, match="one task per GPU"):
        render_sbatch(run_dir="/shared/run", nodes=3, tasks=4, gpus_per_node=8)


def test_bad_sbatch_option_is_refused() -> None:
    with pytest.raises(LaunchError, match="cannot quote"):
        render_sbatch(run_dir="/r", nodes=3, sbatch_options={"comment": "a b"})
    with pytest.raises(LaunchError, match="long name"):
        render_sbatch(run_dir="/r", nodes=3, sbatch_options={"--time": "5"})


def test_in_job_recovery_lines_keep_srun_status() -> None:
    lines = recovery_lines(Path("/r"), "/state", slurm_guard="/bin/slurm-guard")
    assert lines[0] == "sg_rc=$?"
    assert "/bin/slurm-guard recover --run-dir /r --state-dir /state" in lines[1]
    assert lines[-1] == 'exit "$sg_rc"'


# ------------------------------------------------------------------ one Slurm query per job step


def _task_env(rank: int, run_dir: Path | None, **extra: str) -> dict[str, str]:
    env = {
        **TASK_ENV,
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": "3",
        "SLURM_NODEID": str(rank),
        "SLURM_LOCALID": "0",
        "SLURM_STEP_ID": "0",
        **extra,
    }
    if run_dir is not None:
        env[RUN_DIR_ENV] = str(run_dir)
    return env


def test_hostlists_expand_as_scontrol_does() -> None:
    """Every task expands the node list itself: the recorded output of `scontrol show hostnames`
    (local cluster, tests/data/hostnames_forms.json) for zero padding, mixed widths, several
    brackets and lists."""
    recorded = json.loads((DATA / "hostnames_forms.json").read_text())
    assert len(recorded["expansions"]) >= 15
    for expr, names in recorded["expansions"].items():
        assert expand_hostlist(expr) == names, expr


def test_only_rank_zero_asks_slurm_and_the_others_read_its_record(tmp_path: Path) -> None:
    client = FakeClient({"gpu-07": "10.1.2.7"})
    zero = task_from_env(_task_env(0, tmp_path))
    assert step_rendezvous_address(zero, client, _task_env(0, tmp_path)) == "10.1.2.7"  # type: ignore[arg-type]
    assert client.asked == ["gpu-07"]

    def factory() -> Any:
        raise AssertionError("a rank other than 0 built a Slurm client")

    for rank in (1, 2):
        task = task_from_env(_task_env(rank, tmp_path))
        assert step_rendezvous_address(task, factory, _task_env(rank, tmp_path)) == "10.1.2.7"
    record = json.loads(rendezvous_file(tmp_path, zero, "0").read_text())
    assert record == {"job": "4242", "node": "gpu-07", "address": "10.1.2.7", "error": None}
    # a requeued run (restart count 3) does not take the previous run's record
    later = task_from_env(_task_env(1, tmp_path, SLURM_RESTART_COUNT="3"))
    with pytest.raises(LaunchError, match="did not publish"):
        step_rendezvous_address(later, factory, _task_env(1, tmp_path), timedelta(seconds=0.2))


def test_a_waiting_rank_times_out_with_the_fix() -> None:
    task = task_from_env(_task_env(2, Path("/nonexistent-run-dir")))
    with pytest.raises(LaunchError) as info:
        step_rendezvous_address(
            task, None, _task_env(2, Path("/nonexistent-run-dir")), timedelta(seconds=0.3)
        )
    message = str(info.value)
    assert "rank 2: rank 0 did not publish" in message and ADDR_ENV in message
    assert "shared by all nodes" in message


def test_rank_zeros_failure_reaches_the_others_at_once(tmp_path: Path) -> None:
    client = FakeClient({"gpu-07": ""})  # Slurm reports no NodeAddr
    zero = task_from_env(_task_env(0, tmp_path))
    with pytest.raises(LaunchError, match="no NodeAddr"):
        step_rendezvous_address(zero, client, _task_env(0, tmp_path))  # type: ignore[arg-type]
    one = task_from_env(_task_env(1, tmp_path))
    with pytest.raises(
        LaunchError, match=r"rank 0 could not find the rendezvous address.*NodeAddr"
    ):
        # a zero wait still reads the record once: rank 0's cause, not a timeout
        step_rendezvous_address(one, None, _task_env(1, tmp_path), timedelta(0))


def test_a_preset_address_asks_nobody_and_no_run_dir_asks_every_task(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def factory() -> Any:
        raise AssertionError("asked Slurm although the address was preset")

    env = _task_env(1, tmp_path, **{ADDR_ENV: "10.9.9.9"})
    assert step_rendezvous_address(task_from_env(env), factory, env) == "10.9.9.9"
    assert not (tmp_path / ".rendezvous").exists()
    client = FakeClient({"gpu-07": "10.1.2.7"})
    env = _task_env(1, None)
    with caplog.at_level("WARNING", logger="slurm_guard"):
        assert step_rendezvous_address(task_from_env(env), client, env) == "10.1.2.7"  # type: ignore[arg-type]
    assert client.asked == ["gpu-07"] and RUN_DIR_ENV in caplog.text


def test_a_record_for_another_first_node_is_refused(tmp_path: Path) -> None:
    zero = task_from_env(_task_env(0, tmp_path))
    step_rendezvous_address(zero, FakeClient({"gpu-07": "10.1.2.7"}), _task_env(0, tmp_path))  # type: ignore[arg-type]
    other = task_from_env(_task_env(1, tmp_path, SLURM_STEP_NODELIST="gpu-[01-03]"))
    with pytest.raises(LaunchError, match="names node 'gpu-07'"):
        step_rendezvous_address(other, None, _task_env(1, tmp_path), timedelta(seconds=1))


def test_a_requeued_run_removes_its_earlier_runs_records_only(tmp_path: Path) -> None:
    client = FakeClient({"gpu-07": "10.1.2.7"})
    first = task_from_env(_task_env(0, tmp_path))
    step_rendezvous_address(first, client, _task_env(0, tmp_path))  # type: ignore[arg-type]
    earlier = rendezvous_file(tmp_path, first, "0")
    other_job = earlier.with_name("999." + earlier.name.split(".", 1)[1])
    other_job.write_text(earlier.read_text())
    env = _task_env(0, tmp_path, SLURM_RESTART_COUNT="3")  # the first run had 2
    requeued = task_from_env(env)
    assert step_rendezvous_address(requeued, client, env) == "10.1.2.7"  # type: ignore[arg-type]
    records = sorted(p.name for p in earlier.parent.iterdir())
    assert records == sorted([rendezvous_file(tmp_path, requeued, "0").name, other_job.name])
