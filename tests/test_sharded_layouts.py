"""ShardedGuard in the layouts large runs use: FSDP2, HSDP, FSDP2 + TP, HSDP + TP (and DDP).

Real processes on gloo, torchtitan's TP plan on the tiny Llama, two ranks per node where a TP
pair shares one (SLURMD_NODENAME per rank, as `srun --ntasks-per-node=2` sets it). Kept few
and small: the 6- and 8-rank launches are the expensive ones on CI's two cores.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from sharded_layout_workers import (
    TRUST_ONE,
    ddp_clean,
    ddp_over_tp,
    pipeline,
    resume_3x2,
    train,
    train_3x2,
)

from slurm_guard.checks.verdicts import ReplayResult
from slurm_guard.comm.topology import RankInfo, Topology
from slurm_guard.errors import GuardError
from slurm_guard.local.launch import RankOutcome, run_local
from slurm_guard.protocol import Verdict
from slurm_guard.rundir.records import RecordError, read_ledger
from slurm_guard.rundir.trust import parse_checkpoint_meta
from slurm_guard.sharded.checkpoint import other_mesh
from slurm_guard.sharded.layout import Layout
from slurm_guard.sharded.snapshot_state import apply_shards, mesh_of
from slurm_guard.sharded.verdict import judge_by_tp

PAIRS = ["node1", "node1", "node2", "node2", "node3", "node3"]  # dp=3 x tp=2, 2 ranks a node
ONE_EACH = ["node1", "node2", "node3", "node4"]


def _values(outcomes: list[RankOutcome]) -> list[dict[str, Any]]:
    assert [o.status for o in outcomes] == ["ok"] * len(outcomes), [o.value for o in outcomes]
    return [o.value for o in outcomes]


def _alarm(outcomes: list[RankOutcome]) -> dict[str, Any]:
    assert [o.status for o in outcomes] == ["alarm"] * len(outcomes), [o.value for o in outcomes]
    alarms = [json.loads(o.value) if isinstance(o.value, str) else o.value for o in outcomes]
    assert len({a["alarm_id"] for a in alarms}) == 1  # every rank raised the same record
    alarm: dict[str, Any] = alarms[0]
    return alarm


def _identical(values: list[dict[str, Any]]) -> None:
    """Guarded and unguarded runs of one launch: the same loss bits and shards on every rank."""
    for v in values:
        assert v["losses"] == v["plain"]["losses"]  # Python floats compared exactly
        assert v["digest"] == v["plain"]["digest"]
        assert v["verified"]  # replays ran and passed: they did not change training


# ------------------------------------------------------------------ pure parts


def test_replays_pair_data_parallel_indices_at_one_tp_index_on_other_nodes() -> None:
    layout = Layout((((0, 1), (2, 3), (4, 5)),))  # FSDP2 over 3 indices x TP 2
    assert (layout.dp_indices, layout.tp, layout.describe()) == (3, 2, "FSDP2 3 x TP 2")
    first, settle = layout.replay_shifts(lambda r: PAIRS[r])
    assert (first, settle) == (1, 2)
    for owner, replayer in layout.pairs(first):
        assert layout.tp_index(owner) == layout.tp_index(replayer)
        assert PAIRS[owner] != PAIRS[replayer]
    assert layout.shard_groups() == [[0, 2, 4], [1, 3, 5]]  # each TP index reduces its own
    assert layout.copies() == [[0], [1], [2], [3], [4], [5]]  # no replica: nothing to vote on
    hsdp_tp = Layout((((0, 1), (2, 3)), ((4, 5), (6, 7))))
    assert hsdp_tp.copies() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert Layout((((0, 1), (2, 3)),)).replay_shifts(str) == (1, None)  # two: no third


def _r(owner: int, replayer: int, good: bool) -> ReplayResult:
    return ReplayResult(owner, replayer, 1, 5, 1, 5 if good else 6)


def test_a_fault_on_a_whole_node_is_judged_per_tp_index() -> None:
    """Both ranks of node2 wrong: no rank is common to all four failed comparisons, but each
    TP index's two failures share one rank, and both are on node2."""
    layout = Layout((((0, 1), (2, 3), (4, 5)),))
    topology = Topology.build([RankInfo(r, n, "h") for r, n in enumerate(PAIRS)])
    first = [_r(o, rep, "node2" not in (PAIRS[o], PAIRS[rep])) for o, rep in layout.pairs(1)]
    finding = judge_by_tp(first, None, topology, layout)
    assert finding is not None and finding.verdict == Verdict.SDC
    assert finding.suspect_ranks == (2, 3)


def test_a_sharded_checkpoint_records_its_mesh_and_another_layout_is_refused_by_name() -> None:
    fsdp_tp, fsdp4 = Layout((((0, 1), (2, 3)),)), Layout((((0,), (1,), (2,), (3,)),))
    recorded = {
        **{"schema": 1, "step": 2, "weight_fingerprint": "ab", "clean_vote": True, "world_size": 4},
        "files": {".metadata": "00"},
        "restart_count": 0,
        "created": 1.0,
        "shard_fingerprints": ["00"] * 4,
        "layout": fsdp_tp.describe(),
        "coordinates": fsdp_tp.coordinates(),
    }
    meta = parse_checkpoint_meta(json.loads(json.dumps(recorded)), "meta")
    assert (meta.layout, meta.coordinates) == (
        "FSDP2 2 x TP 2",
        [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]],
    )
    assert other_mesh(meta, 4, fsdp_tp) is None
    said = other_mesh(meta, 4, fsdp4)
    assert said is not None and said.startswith(
        "checkpoint step-00000002 was saved on FSDP2 2 x TP 2 and this run is FSDP2 4 (rank 1 "
        "at [replicate, shard, TP] [0, 0, 1] there, [0, 1, 0] here)"
    )
    assert "Resume on the saved layout (FSDP2 2 x TP 2, on 4 ranks)" in said
    assert "SLURM_GUARD_RESUME=fresh" in said
    other_order = Layout((((0, 2), (1, 3)),))  # the same shape, the ranks placed otherwise
    assert "rank 1 at [replicate, shard, TP] [0, 0, 1] there, [0, 1, 0] here" in str(
        other_mesh(meta, 4, other_order)
    )
    assert "on 4 ranks and this run has 8" in str(other_mesh(meta, 8, fsdp4))
    older = {k: v for k, v in recorded.items() if k not in ("layout", "coordinates")}
    meta = parse_checkpoint_meta(older, "meta")  # an older slurm-guard's: its shards prove it
    assert meta.coordinates is None and other_mesh(meta, 4, fsdp4) is None
    for bad in (
        {"layout": 4},
        {"coordinates": "FSDP2 4"},
        {"coordinates": [[0, 0, 0]] * 3},  # not one per rank
        {"coordinates": [[0, 0]] * 4},
        {"coordinates": [[0, 0, "1"]] * 4},
        {"coordinates": [[0, True, 0]] * 4},
        {"coordinates": [[0, -1, 0]] * 4},
    ):
        with pytest.raises(RecordError):
            parse_checkpoint_meta({**recorded, **bad}, "meta")
    # a shard snapshot records its place too, and is not loaded at another
    saved = {"model": {}, "optimizer": {}, "mesh": mesh_of(fsdp_tp, 1)}
    model = torch.nn.Linear(2, 2)
    with pytest.raises(GuardError, match=r"FSDP2 2 x TP 2.*this rank is at.*FSDP2 4"):
        apply_shards(model, torch.optim.SGD(model.parameters()), saved, mesh_of(fsdp4, 1))


# ------------------------------------------------------------------ dp=3 x tp=2, 3 nodes


@pytest.mark.distributed
def test_fsdp_tp_3x2_catches_a_node_fault_and_resumes_elsewhere_bit_identically(
    tmp_path: Path,
) -> None:
    clean = _values(run_local(train_3x2, 6, args=(str(tmp_path / "clean"), 5, True), nodes=PAIRS))
    _identical(clean)
    assert clean[0]["layout"] == "FSDP2 3 x TP 2"
    run = str(tmp_path / "run")
    inject = {"SLURM_GUARD_INJECT": "kind=grad-scale,node=node2,step=3,persistent=1"}
    alarm = _alarm(run_local(train_3x2, 6, args=(run, 5), nodes=PAIRS, extra_env=inject))
    assert (alarm["check"], alarm["verdict"], alarm["step"]) == ("replay", "sdc", 4)
    assert alarm["suspect_nodes"] == ["node2"] and alarm["suspect_ranks"] == [2, 3]
    assert alarm["injected"] is True and alarm["last_verified_step"] == 2
    # the relaunch on node1, node3, node4: from the checkpoint of step 2 (at the onset: 3)
    elsewhere = ["node1", "node1", "node3", "node3", "node4", "node4"]
    resumed = _values(run_local(resume_3x2, 6, args=(run, 5), nodes=elsewhere))
    for a, b in zip(clean, resumed, strict=True):
        assert b["start"] == 2
        assert b["losses"] == a["losses"][2:] and b["digest"] == a["digest"]


@pytest.mark.distributed
def test_fsdp_tp_3x2_names_the_one_wrong_rank_of_a_node(tmp_path: Path) -> None:
    inject = {"SLURM_GUARD_INJECT": "kind=grad-scale,rank=3,step=1,persistent=1"}
    outcomes = run_local(train_3x2, 6, args=(str(tmp_path), 3), nodes=PAIRS, extra_env=inject)
    alarm = _alarm(outcomes)
    assert (alarm["check"], alarm["verdict"], alarm["step"]) == ("replay", "sdc", 2)
    assert alarm["suspect_ranks"] == [3] and alarm["suspect_nodes"] == ["node2"]


# ------------------------------------------------------------------ 4 ranks


TP22 = functools.partial(train, shards=2, tp=2)
FSDP4 = functools.partial(train, shards=4)
UPDATES = {"update_check": True}  # off by default (its memory): on where a test reads it


@pytest.mark.distributed
def test_fsdp_tp_2x2_a_rank_fault_convicts_nobody_and_resumes_from_a_replayed_snapshot(
    tmp_path: Path,
) -> None:
    """FSDP2 2 x TP 2 with snapshots: no replica, so a snapshot follows each passing replay
    (the state that replayed step started from), with a copy on the peer node.

    Launch 1: a persistent fault on rank 3 from step 3 alarms at the replay of step 4; two
    data-parallel indices have no third to settle it, so the verdict convicts nobody.
    Launch 2, on node1 and node3 (node2 replaced, its memory gone): the ledger proves the
    snapshot of step 2 by its passing replay, ranks 2 and 3 get their shards from node1, and
    the run ends bit-identical to the unguarded one (the checkpoint of step 2 is older than
    nothing: the snapshot of the same step is taken). Launch 3, the same ranks as FSDP2 4:
    the checkpoint's recorded layout refuses the resume by name. (Its clean run:
    test_a_guarded_clean_run_is_bit_identical_to_the_unguarded_one.)"""
    run, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    inject = {"SLURM_GUARD_INJECT": "kind=grad-scale,rank=3,step=3,persistent=1"}
    snapshots = functools.partial(TP22, shm=shm, config=TRUST_ONE, save_at=(2,))
    alarm = _alarm(run_local(snapshots, 4, args=(run, 5), nodes=PAIRS[:4], extra_env=inject))
    # two data-parallel indices: rank 3 and its partner disagree, and no third index settles
    assert (alarm["check"], alarm["verdict"], alarm["step"]) == ("replay", "ambiguous", 4)
    assert 3 in alarm["suspect_ranks"] and set(alarm["suspect_ranks"]) <= {1, 3}
    assert alarm["last_verified_step"] == 2
    run_file = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run_file["layout"]["describe"] == "FSDP2 2 x TP 2"
    assert run_file["replayer"] == [2, 3, 0, 1]  # the other index, at the same TP index
    elsewhere = ["node1", "node1", "node3", "node3"]
    again = functools.partial(snapshots, resume=True, compare=True)
    resumed = _values(run_local(again, 4, args=(run, 5), nodes=elsewhere))
    for v in resumed:
        assert v["start"] == 2
        assert v["losses"] == v["plain"]["losses"][2:] and v["digest"] == v["plain"]["digest"]
    # node1 keeps node2's copies; its first rank sends both
    assert [v["restored_from_peers"] for v in resumed] == [[], [], [0], [0]]
    # Launch 3: the same 4 ranks as FSDP2 4 find the checkpoint of step 2 (FSDP2 2 x TP 2)
    refused = run_local(functools.partial(FSDP4, resume=True), 4, args=(run, 5), nodes=ONE_EACH)
    assert [o.status for o in refused] == ["error"] * 4, [o.value for o in refused]
    said = str(refused[0].value)
    assert "saved on FSDP2 2 x TP 2 and this run is FSDP2 4" in said, said
    assert "SLURM_GUARD_RESUME=fresh" in said


@pytest.mark.distributed
def test_plain_fsdp2_replays_and_names_the_node_of_a_gradient_fault(tmp_path: Path) -> None:
    """No replica, abft off: the replay across data-parallel indices catches it."""
    inject = {"SLURM_GUARD_INJECT": "kind=grad-scale,node=node2,step=1,persistent=1"}
    outcomes = run_local(FSDP4, 4, args=(str(tmp_path), 3), nodes=ONE_EACH, extra_env=inject)
    alarm = _alarm(outcomes)
    assert (alarm["check"], alarm["verdict"], alarm["step"]) == ("replay", "sdc", 2)
    assert alarm["suspect_nodes"] == ["node2"] and alarm["suspect_ranks"] == [1]
    # run.json records the mesh and the replays' own pairs (not the DDP ring's)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["layout"] == {"describe": "FSDP2 4", "coordinates": [[0, r, 0] for r in range(4)]}
    assert run["replayer"] == [3, 0, 1, 2]  # index d replayed by d - 1, each on another node


@pytest.mark.distributed
def test_plain_fsdp2_update_check_names_the_rank_whose_update_is_wrong(tmp_path: Path) -> None:
    """No replica to vote with: a bit flipped in rank 1's shard after its update (step 1, a
    vote step) is caught by the update check, rank 0 recomputing rank 1's update and rank 3
    settling it."""
    inject = {"SLURM_GUARD_INJECT": "kind=weight-bitflip,rank=1,step=1,bit=30"}
    checked = functools.partial(FSDP4, config=UPDATES)
    outcomes = run_local(checked, 4, args=(str(tmp_path), 3), nodes=ONE_EACH, extra_env=inject)
    alarm = _alarm(outcomes)
    assert (alarm["check"], alarm["verdict"], alarm["step"]) == ("update", "sdc", 1)
    assert alarm["suspect_ranks"] == [1] and alarm["suspect_nodes"] == ["node2"]
    assert alarm["injected"] is True and alarm["update_applied"] is True


@pytest.mark.distributed
def test_a_failure_inside_the_update_check_stops_every_rank_with_its_cause(
    tmp_path: Path,
) -> None:
    """Rank 0 cannot read what rank 1 sent for its update (an object in rank 1's param_group):
    every rank stops with the same named error at that step's check, none hangs."""
    odd = functools.partial(FSDP4, opaque_on=1, config=UPDATES)
    outcomes = run_local(odd, 4, args=(str(tmp_path), 3), nodes=ONE_EACH)
    assert [o.status for o in outcomes] == ["error"] * 4, [o.value for o in outcomes]
    said = {str(o.value) for o in outcomes}
    assert len(said) == 1, said
    text = said.pop()
    assert "step 1: the update check" in text and "recomputing rank 1's update" in text, text


@pytest.mark.distributed
def test_ranks_that_differ_on_whether_their_update_can_be_checked_stop_at_the_start(
    tmp_path: Path,
) -> None:
    """Rank 2 alone has a step hook, so only its update could not be recomputed: agreed at
    construction (the setup check names the field), never a rank waiting on an exchange its
    partner skips."""
    hooked = functools.partial(FSDP4, hooked_on=2, config=UPDATES)
    outcomes = run_local(hooked, 4, args=(str(tmp_path), 3), nodes=ONE_EACH)
    assert [o.status for o in outcomes] == ["error"] * 4, [o.value for o in outcomes]
    said = str(outcomes[0].value)
    assert "rank 2: update_check=" in said and "with step hooks" in said, said


# FSDP2 + TP's clean run: the dp=3 x tp=2 test above and torchtitan's Llama3 below; HSDP + TP's:
# test_hsdp_tp_resumes_on_another_node_set_from_a_checkpoint_then_a_snapshot.
EVERY_STEP = {"vote_every": 1, **UPDATES}  # the update check (FSDP2) or shard vote (HSDP)
LAYOUTS = {
    "fsdp2": (4, functools.partial(train, shards=4, compare=True, config=EVERY_STEP)),
    "hsdp": (4, functools.partial(train, shards=2, replicas=2, compare=True)),
}


def _update_checks(run_dir: Path) -> list[tuple[int, bool]]:
    """The update checks the ledger records: (step, passed)."""
    entries = read_ledger(run_dir / "ledger.jsonl")
    return [(e.step, e.passed) for e in entries if e.check == "update"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_guarded_clean_run_is_bit_identical_to_the_unguarded_one(
    tmp_path: Path, name: str
) -> None:
    """FSDP2 with the update check on every step (HSDP has a vote instead, no update check)."""
    world, worker = LAYOUTS[name]
    nodes = [f"node{r // 2 + 1}" for r in range(world)]
    _identical(_values(run_local(worker, world, args=(str(tmp_path), 3), nodes=nodes)))
    checked = [(0, True), (1, True), (2, True)] if name == "fsdp2" else []
    assert _update_checks(tmp_path) == checked


HSDP_TP = functools.partial(train, shards=2, replicas=2, tp=2, config=TRUST_ONE, save_at=(2,))
FOUR = ["node1", "node1", "node2", "node2", "node3", "node3", "node4", "node4"]


@pytest.mark.distributed
@pytest.mark.slow
def test_hsdp_tp_resumes_on_another_node_set_from_a_checkpoint_then_a_snapshot(
    tmp_path: Path,
) -> None:
    """HSDP 2 x 2 x TP 2 (8 ranks, 2 a node on 4 nodes), snapshots in a directory per node
    and a sealed DCP checkpoint of step 2; replays and votes every 2 steps.

    Launch 1, clean: guarded (with its snapshots and its save) bit-identical to unguarded.
    Launch 2, the run restarted with the nodes' memory gone (another snapshot root): it loads
    the DCP checkpoint of step 2 on the 3-D mesh; a persistent fault on node2 from step 5 is
    convicted at the replay of step 6 (the vote of step 5 passes: the replicas agree on the
    wrong update). Launch 3, on node1, node5, node3, node4 (node2 replaced, node5 empty): the
    snapshot of step 4 (launch 2's, taken after the DCP load) is restored, ranks 2 and 3 from
    node3's copies, and the run ends bit-identical to launch 1's unguarded one, which also
    shows the checkpoint load of launch 2 was exact."""
    run = str(tmp_path / "run")
    first = functools.partial(HSDP_TP, compare=True, shm=str(tmp_path / "shm1"))
    clean = _values(run_local(first, 8, args=(run, 7), nodes=FOUR))
    _identical(clean)
    assert clean[0]["layout"] == "HSDP 2x2 x TP 2"
    shm = str(tmp_path / "shm2")
    inject = {"SLURM_GUARD_INJECT": "kind=grad-scale,node=node2,step=5,persistent=1"}
    restart = functools.partial(HSDP_TP, resume=True, shm=shm)
    alarm = _alarm(run_local(restart, 8, args=(run, 7), nodes=FOUR, extra_env=inject))
    assert (alarm["check"], alarm["verdict"], alarm["step"]) == ("replay", "sdc", 6)
    assert alarm["suspect_nodes"] == ["node2"] and alarm["last_verified_step"] == 4
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "run" / "resumes").iterdir()]
    assert (record["source"], record["step"]) == ("checkpoint", 2)
    elsewhere = [*FOUR[:2], "node5", "node5", *FOUR[4:]]
    resumed = _values(run_local(restart, 8, args=(run, 7), nodes=elsewhere))
    for a, b in zip(clean, resumed, strict=True):
        assert b["start"] == 4
        assert b["losses"] == a["plain"]["losses"][4:] and b["digest"] == a["plain"]["digest"]
    # node3 keeps node2's copies; its first rank sends both
    assert [v["restored_from_peers"] for v in resumed] == [[], [], [4], [4], [], [], [], []]


@pytest.mark.distributed
def test_ddp_guarded_clean_run_is_bit_identical_to_the_unguarded_one(tmp_path: Path) -> None:
    (value, _) = _values(run_local(ddp_clean, 2, args=(str(tmp_path), 3), nodes=ONE_EACH[:2]))
    assert value["guarded"] == value["plain"]


# ------------------------------------------------------------------ refused by name


@pytest.mark.distributed
@pytest.mark.parametrize("fsdp", [True, False], ids=["fully_shard-stages", "ddp-stages"])
def test_a_two_stage_pipeline_is_refused_by_name(tmp_path: Path, fsdp: bool) -> None:
    said = _values(run_local(pipeline, 4, args=(str(tmp_path), fsdp), nodes=ONE_EACH))
    assert all("pipeline parallel is not supported" in s for s in said), said


@pytest.mark.distributed
def test_ddp_over_tensor_parallel_weights_is_refused(tmp_path: Path) -> None:
    said = _values(run_local(ddp_over_tp, 2, args=(str(tmp_path),), nodes=ONE_EACH[:2]))
    assert all("DDP over DTensors" in s or s.startswith("DDP:") for s in said), said


@pytest.mark.distributed
def test_torchtitan_llama3_with_its_own_tp_and_fsdp_is_placed_and_bit_identical(
    tmp_path: Path,
) -> None:
    """torchtitan 0.3.0's Llama3, parallelized by torchtitan (`model.parallelize`, then
    `apply_fsdp_to_decoder`): the guard places it as FSDP2 2 x TP 2 from its own placements,
    replays it, and trains it bit-identically to the unguarded run."""
    try:
        import torchtitan.models.llama3  # noqa: F401
    except ImportError as exc:
        if os.environ.get("SLURM_GUARD_REQUIRE_TORCHTITAN") == "1":
            raise
        pytest.skip(f"torchtitan 0.3.0 is not installed: {exc}")
    titan = functools.partial(train, shards=2, tp=2, titan=True, compare=True, config=EVERY_STEP)
    values = _values(run_local(titan, 4, args=(str(tmp_path), 3), nodes=PAIRS[:4]))
    assert values[0]["layout"] == "FSDP2 2 x TP 2"
    _identical(values)
    assert _update_checks(tmp_path) == [(0, True), (1, True), (2, True)]  # and changed nothing
