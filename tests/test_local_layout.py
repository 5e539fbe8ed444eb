"""Several ranks per pose node: the variables srun and torchrun give each rank, and replays
that always pair ranks of different nodes (`comm/topology.py`) in every such layout."""

from __future__ import annotations

import itertools
import os

import pytest

from slurm_guard.checks.verdicts import ReplayResult, judge_replays
from slurm_guard.comm.topology import Topology
from slurm_guard.local.launch import run_local
from slurm_guard.local.script import pose_env
from slurm_guard.rundir.records import RankInfo
from slurm_guard.slurm.task import task_from_env, torchrun_environment

PLACE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
PLACE += ("SLURMD_NODENAME", "SLURM_NODEID", "SLURM_LOCALID")


def test_ranks_per_node_gives_what_srun_and_slurm_guard_task_give() -> None:
    """Rank 3 of 3 nodes x 2: node2's second task, as `srun --ntasks-per-node=2` would start
    it and `slurm-guard task` would export torchrun's variables for it."""
    env = pose_env(3, 6, 29500, ranks_per_node=2)
    srun = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "6",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_STEP_NODELIST": "node[1-3]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
        "SLURM_JOB_ID": "7",
        "SLURMD_NODENAME": "node2",
    }
    expected = {
        **torchrun_environment(task_from_env(srun), "127.0.0.1", 29500),
        **{k: srun[k] for k in ("SLURMD_NODENAME", "SLURM_NODEID", "SLURM_LOCALID")},
    }
    assert env == expected
    assert [env[k] for k in PLACE] == ["3", "6", "1", "2", "1", "3", "node2", "1", "1"]
    assert "SLURM_JOB_ID" not in env and "SLURM_NTASKS" not in env  # no Slurm job is claimed


def test_one_rank_per_node_keeps_local_rank_the_rank() -> None:
    env = pose_env(2, 3, 29500)
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["SLURMD_NODENAME"]) == (
        "2",
        "3",
        "node3",
    )
    with pytest.raises(ValueError):
        pose_env(0, 5, 29500, ranks_per_node=2)


def _layouts() -> list[list[str]]:
    """Every node assignment of up to 8 ranks on up to 4 nodes, in block and cyclic order and
    uneven, where no node holds more than half of the ranks."""
    out = []
    for world in range(2, 9):
        for nodes in itertools.product("abcd", repeat=world):
            counts = [nodes.count(n) for n in set(nodes)]
            if 2 * max(counts) <= world and nodes[0] == "a":
                out.append(list(nodes))
    return out


def test_replays_pair_ranks_of_different_nodes_in_every_layout() -> None:
    layouts = _layouts()
    assert ["a", "a", "b", "b", "c", "c"] in layouts and ["a", "b", "c", "a", "b", "c"] in layouts
    for nodes in layouts:
        t = Topology.build([RankInfo(r, n, "host") for r, n in enumerate(nodes)])
        assert sorted(t.replayer) == list(range(len(nodes))), nodes  # a permutation
        for owner, replayer in enumerate(t.replayer):
            assert nodes[owner] != nodes[replayer], (nodes, owner, replayer)
            third = t.third_rank(owner, replayer)
            if len(set(nodes)) > 2:
                assert third is not None and nodes[third] not in (nodes[owner], nodes[replayer])


def test_a_fault_on_one_rank_of_a_two_rank_node_names_that_rank_not_its_neighbour() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    t = Topology.build([RankInfo(r, n, "host") for r, n in enumerate(nodes)])
    for bad in range(6):
        res = [
            ReplayResult(o, r, 99 if o == bad else 1, 1, 99 if r == bad else 1, 1)
            for o, r in enumerate(t.replayer)
        ]
        finding = judge_replays(res, t).finding
        assert finding is not None and finding.verdict == "sdc"
        assert finding.suspect_ranks == (bad,), (bad, finding)


def _place() -> dict[str, str]:
    return {k: os.environ.get(k, "") for k in PLACE}


@pytest.mark.distributed
def test_run_local_places_ranks_per_node_as_the_launcher_does() -> None:
    outcomes = run_local(_place, 4, ranks_per_node=2, timeout=120)
    assert [o.status for o in outcomes] == ["ok"] * 4, outcomes
    for o in outcomes:
        expected = pose_env(o.rank, 4, 0, ranks_per_node=2)
        assert o.value == {k: expected[k] for k in PLACE}
