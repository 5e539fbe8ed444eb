"""ShardedGuard on 4 gloo ranks: HSDP as 2 replica groups x 2 shards, FSDP2 as one group of 4.

Real FSDP2 (`fully_shard` on a tiny Llama-like model), real processes, real DCP files; faults
through SLURM_GUARD_INJECT as a drill would inject them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sharded_guard_workers import (
    train,
    train_fsdp,
    train_fsdp_abft,
    train_fsdp_abft_resumed,
    train_fsdp_abft_saving,
    train_resumed,
    train_resumed_other_data,
    train_saving,
    train_three_groups,
)

from slurm_guard.checks.rows import bits
from slurm_guard.checks.verdicts import ReplayResult
from slurm_guard.comm.topology import RankInfo, Topology
from slurm_guard.local.launch import RankOutcome, run_local
from slurm_guard.protocol import Verdict
from slurm_guard.sharded import verdict as v
from slurm_guard.sharded.layout import Layout
from slurm_guard.sharded.verdict import judge_shard_vote, judge_sharded_replays

NODES = ["n0", "n1", "n2", "n3"]
SIX = [f"n{r}" for r in range(6)]


def _alarms(outcomes: list[RankOutcome]) -> list[dict[str, object]]:
    assert [o.status for o in outcomes] == ["alarm"] * len(outcomes), [o.value for o in outcomes]
    alarms = [json.loads(o.value) if isinstance(o.value, str) else o.value for o in outcomes]
    assert len({a["alarm_id"] for a in alarms}) == 1  # every rank raised the same record
    return alarms


def _ok(outcomes: list[RankOutcome]) -> list[dict[str, object]]:
    assert [o.status for o in outcomes] == ["ok"] * 4, [o.value for o in outcomes]
    return [o.value for o in outcomes]


# ------------------------------------------------------------------ pure parts


def Mesh(rows: tuple[tuple[int, ...], ...]) -> Layout:
    """An HSDP layout without tensor parallel: rows are replica groups."""
    return Layout(tuple(tuple((r,) for r in row) for row in rows))


def test_mesh_pairs_replay_another_data_parallel_index_and_settle_elsewhere() -> None:
    mesh = Mesh(((0, 1), (2, 3)))
    own_node = mesh.replay_shifts(lambda r: f"n{r}")
    assert own_node == (1, 2)  # four data-parallel indices: a third opinion is there
    assert sorted(mesh.pairs(1)) == [(0, 3), (1, 0), (2, 1), (3, 2)]
    # two ranks per node (0,1 on n0): the first round crosses nodes
    assert mesh.replay_shifts(lambda r: f"n{r // 2}") == (2, 1)
    assert Mesh(((0,), (1,))).replay_shifts(str) == (1, None)  # two copies and nothing else


def _result(owner: int, replayer: int, good: bool) -> ReplayResult:
    return ReplayResult(owner, replayer, 1, 5, 1, 5 if good else 6)


def test_two_replica_groups_attribute_through_the_settling_round() -> None:
    topology = Topology.build([RankInfo(r, f"n{r}", "h") for r in range(4)])
    first = [_result(2, 0, True), _result(3, 1, False), _result(0, 2, True), _result(1, 3, False)]
    # rank 3 alone is ambiguous against rank 1 until a third rank recomputes
    second = [_result(3, 0, False), _result(2, 1, True), _result(1, 2, True), _result(0, 3, False)]
    finding = judge_sharded_replays(first, second, topology)
    assert finding is not None and finding.verdict == Verdict.SDC
    assert finding.suspect_ranks == (3,)


def test_shard_vote_names_the_odd_replica_or_is_ambiguous_with_two() -> None:
    three = Mesh(((0, 1), (2, 3), (4, 5)))
    finding = judge_shard_vote([7, 8, 7, 9, 7, 8], three)
    assert finding is not None and finding.verdict == Verdict.SDC and finding.suspect_ranks == (3,)
    two = Mesh(((0, 1), (2, 3)))
    finding = judge_shard_vote([7, 8, 7, 9], two)
    assert finding is not None and finding.verdict == Verdict.AMBIGUOUS
    assert finding.suspect_ranks == (1, 3)
    assert judge_shard_vote([7, 8, 7, 8], two) is None


def test_the_start_line_names_the_layout_and_only_the_checks_it_runs() -> None:
    """FSDP2 + TP has no second copy of a shard: the line must not promise a vote (it did,
    the DDP guard's "weight vote every 1 steps" for every layout), and it names the layout."""
    from slurm_guard import GuardConfig
    from slurm_guard.core.events import checks_line

    def line(layout: Layout, config: GuardConfig) -> str:
        world = layout.replicas * layout.shards * layout.tp
        return checks_line(
            config,
            world,
            2,
            layout=layout.describe(),
            dp_indices=layout.dp_indices,
            replicas=layout.replicas,
        )

    config = GuardConfig(replay_every=2, vote_every=5, abft=True, snapshots=True)
    fsdp_tp = Layout((((0, 1), (2, 3)),))  # dp=2 x tp=2
    assert line(fsdp_tp, config) == (
        "4 ranks on 2 nodes (FSDP2 2 x TP 2); finite + reduce-scatter conservation checks every "
        "step, replay every 2 steps, no vote (no replica group holds a second copy of a shard), "
        "optimizer update unchecked (update_check=False), checked GEMMs every step, node-local "
        "snapshots at each passing replay"
    )
    checked = GuardConfig(replay_every=2, vote_every=5, update_check=True)
    assert checks_line(
        checked, 4, 2, layout="FSDP2 4", dp_indices=4, replicas=1, update_check=True
    ).endswith(
        "no vote (no replica group holds a second copy of a shard), optimizer update "
        "recomputed on another node every 5 steps"
    )
    hsdp_tp = Layout((((0, 1), (2, 3)), ((4, 5), (6, 7))))
    assert line(hsdp_tp, GuardConfig(replay_every=2, vote_every=5)) == (
        "8 ranks on 2 nodes (HSDP 2x2 x TP 2); finite + reduce-scatter conservation checks "
        "every step, replay every 2 steps, shard vote between replica groups every 5 steps and "
        "before every save"
    )
    unchecked = line(fsdp_tp, GuardConfig(replay_every=2, finite_check=False))
    assert unchecked.startswith(
        "4 ranks on 2 nodes (FSDP2 2 x TP 2); no finite or reduce-scatter conservation check "
        "(finite_check=False), replay every 2 steps, no vote ("
    ), unchecked


# ------------------------------------------------------------------ 4 gloo ranks


@pytest.mark.distributed
def test_conservation_is_judged_per_shard_group_against_its_bound() -> None:
    import torch

    def row(residual: float, l1: float) -> list[int]:
        out = [0] * v.ROW
        out[v.CONSERVE_RESIDUAL] = int(bits(torch.tensor(residual)))
        out[v.CONSERVE_L1] = int(bits(torch.tensor(l1)))
        return out

    mesh = Mesh(((0, 1), (2, 3)))
    bound = lambda l1: 1e-6 * sum(l1)  # noqa: E731
    # rank errors that cancel within their group are no error: only the group's sum counts
    assert (
        v.judge_conservation([row(3e-6, 1), row(-3e-6, 1), row(0, 1), row(0, 1)], mesh, bound)
        is None
    )
    finding = v.judge_conservation([row(0, 1), row(0, 1), row(1e-5, 1), row(0, 1)], mesh, bound)
    assert finding is not None and finding.verdict == Verdict.AMBIGUOUS
    assert finding.suspect_ranks == () and finding.evidence["groups"][0]["ranks"] == [2, 3]
    nan = v.judge_conservation([row(float("nan"), 1), row(0, 1), row(0, 1), row(0, 1)], mesh, bound)
    assert nan is not None  # fail closed


def test_clean_hsdp_run_gives_no_alarm(tmp_path: Path) -> None:
    values = _ok(run_local(train, 4, args=(str(tmp_path), 4), nodes=NODES))
    assert all(v["verified"] == [0, 2] for v in values)  # both replay steps passed
    assert values[0]["digest"] == values[2]["digest"]  # shard 0's replicas agree
    assert values[1]["digest"] == values[3]["digest"]
    assert not list((tmp_path / "alarms").glob("*.json"))


@pytest.mark.distributed
def test_persistent_gradient_fault_is_caught_at_the_next_replay_and_names_its_node(
    tmp_path: Path,
) -> None:
    inject = {"SLURM_GUARD_INJECT": "kind=grad-scale,rank=3,step=1,persistent=1"}
    outcomes = run_local(train, 4, args=(str(tmp_path), 5), nodes=NODES, extra_env=inject)
    alarm = _alarms(outcomes)[0]
    assert (alarm["check"], alarm["verdict"], alarm["step"]) == ("replay", "sdc", 2)
    assert alarm["suspect_ranks"] == [3] and alarm["suspect_nodes"] == ["n3"]
    assert alarm["last_verified_step"] == 0 and alarm["update_applied"] is False
    written = json.loads(next((tmp_path / "alarms").glob("*.json")).read_text())
    assert written["suspect_nodes"] == ["n3"]  # the record the controller drains from


@pytest.mark.distributed
def test_one_off_nan_is_triaged_by_a_replay_in_the_other_replica_group(tmp_path: Path) -> None:
    inject = {"SLURM_GUARD_INJECT": "kind=nan,rank=2,step=1"}  # step 1 is not a replay step
    outcomes = run_local(train, 4, args=(str(tmp_path), 3), nodes=NODES, extra_env=inject)
    alarm = _alarms(outcomes)[0]
    assert (alarm["check"], alarm["verdict"], alarm["step"]) == ("finite_local", "sdc", 1)
    assert alarm["suspect_ranks"] == [2]


@pytest.mark.distributed
@pytest.mark.parametrize(("worker", "group"), [(train, [0, 1]), (train_fsdp, [0, 1, 2, 3])])
def test_a_wrong_reduce_scatter_result_is_caught_by_conservation_on_its_step(
    tmp_path: Path, worker: object, group: list[int]
) -> None:
    """A wrong value in rank 1's output chunk, made by the collective (every input is right):
    no replay sees it (they compare inputs), and under HSDP both replicas of the shard receive
    it alike, so no vote does either. Step 1 is not a replay step."""
    inject = {"SLURM_GUARD_INJECT": "kind=allreduce,rank=1,step=1"}
    outcomes = run_local(worker, 4, args=(str(tmp_path), 3), nodes=NODES, extra_env=inject)
    alarm = _alarms(outcomes)[0]
    assert (alarm["check"], alarm["verdict"], alarm["step"]) == ("conservation", "ambiguous", 1)
    assert alarm["suspect_ranks"] == [] and alarm["update_applied"] is False
    assert [g["ranks"] for g in alarm["evidence"]["groups"]] == [group]  # type: ignore[index]


@pytest.mark.distributed
def test_weight_bit_flip_is_caught_by_the_shard_vote(tmp_path: Path) -> None:
    inject = {"SLURM_GUARD_INJECT": "kind=weight-bitflip,rank=1,step=1,bit=30"}
    outcomes = run_local(train, 4, args=(str(tmp_path), 4), nodes=NODES, extra_env=inject)
    alarm = _alarms(outcomes)[0]
    assert (alarm["check"], alarm["step"], alarm["update_applied"]) == ("vote", 1, True)
    # two replica groups: the vote sees shard 1's copies differ, but not which one is wrong
    assert alarm["verdict"] == "ambiguous" and alarm["suspect_ranks"] == [1, 3]


@pytest.mark.distributed
def test_resume_from_a_dcp_checkpoint_is_bit_identical(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Also what rank 0 says (the ranks' stderr is this process's): the start line once, the
    resume line once, and the data check: no warning for the same batches, one for others
    (that last run also injects a fault that changes no value, which its end must say)."""
    full = _ok(run_local(train_saving, 4, args=(str(tmp_path), 6, 3), nodes=NODES))
    out = capfd.readouterr().err
    start = "slurm-guard: guarding 4 ranks on 4 nodes (HSDP 2x2); finite + reduce-scatter "
    assert out.count(start) == 1, out
    assert "shard vote between replica groups every 1 steps" in out, out
    step = tmp_path / "checkpoints" / "step-00000003"
    meta = json.loads((step / "meta.json").read_text())
    assert {".metadata", "__0_0.distcp", "__3_0.distcp"} <= set(meta["files"])
    assert len(meta["shard_fingerprints"]) == 4
    resumed = _ok(run_local(train_resumed, 4, args=(str(tmp_path), 6), nodes=NODES))
    for a, b in zip(full, resumed, strict=True):
        assert b["start"] == 3
        assert b["losses"] == a["losses"][3:]  # bit for bit: Python floats compared exactly
        assert b["digest"] == a["digest"]
    out = capfd.readouterr().err
    assert out.count(f"slurm-guard: resumed at step 3 from checkpoint {step}\n") == 1, out
    assert "data differs" not in out, out  # step 4's batch, recorded by the first run, is the same
    _ok(run_local(train_resumed_other_data, 4, args=(str(tmp_path), 5), nodes=NODES))
    out = capfd.readouterr().err
    assert out.count("slurm-guard: the data differs at step 4 ") == 1, out
    # and the fault effects at the run's end (end_run): a factor=1 fault changed no value
    spec = "kind=grad-scale,rank=1,step=3,factor=1"
    assert out.count(f"slurm-guard: injected fault {spec} changed no value on n1 (step 3)") == 1


@pytest.mark.distributed
def test_a_tampered_shard_is_refused_on_resume(tmp_path: Path) -> None:
    _ok(run_local(train_saving, 4, args=(str(tmp_path), 3, 3), nodes=NODES))
    shard = tmp_path / "checkpoints" / "step-00000003" / "__2_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-9] ^= 0x10
    shard.write_bytes(bytes(data))
    outcomes = run_local(train_resumed, 4, args=(str(tmp_path), 4), nodes=NODES)
    # the only checkpoint is damaged: every rank refuses with the same error, none trains on
    assert [o.status for o in outcomes] == ["error"] * 4
    assert all("damaged" in o.value or "sha256" in o.value for o in outcomes), outcomes[0].value


@pytest.mark.distributed
def test_fsdp_without_replicas_catches_a_one_off_gemm_fault_with_abft(tmp_path: Path) -> None:
    inject = {"SLURM_GUARD_INJECT": "kind=gemm,rank=1,step=2,layer=3,pass=grad_w"}
    outcomes = run_local(train_fsdp_abft, 4, args=(str(tmp_path), 4), nodes=NODES, extra_env=inject)
    alarm = _alarms(outcomes)[0]
    assert (alarm["check"], alarm["verdict"], alarm["step"]) == ("abft", "sdc", 2)
    assert alarm["suspect_ranks"] == [1] and alarm["suspect_nodes"] == ["n1"]


@pytest.mark.distributed
def test_fsdp_without_replicas_resumes_from_a_step_its_checked_gemms_passed(
    tmp_path: Path,
) -> None:
    """No replica, so no replay: with abft=True the steps whose checks all passed count toward
    trust at the replay cadence (2), and a persistent GEMM fault from step 5 rolls back to the
    checkpoint of step 4, not to step 0."""
    inject = {"SLURM_GUARD_INJECT": "kind=gemm,rank=1,step=5,layer=3,pass=grad_w,persistent=1"}
    first = run_local(
        train_fsdp_abft_saving, 4, args=(str(tmp_path), 8), nodes=NODES, extra_env=inject
    )
    alarm = _alarms(first)[0]
    assert (alarm["check"], alarm["step"], alarm["last_verified_step"]) == ("abft", 5, 4)
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    points = [e["step"] for e in ledger if "trust_point" in e["detail"]]
    assert points == [0, 2, 4]
    resumed = _ok(run_local(train_fsdp_abft_resumed, 4, args=(str(tmp_path), 8), nodes=NODES))
    assert [r["start"] for r in resumed] == [4] * 4


# ------------------------------------------------------------------ 3 replica groups (3x2)


@pytest.mark.distributed
def test_a_third_replica_group_settles_a_single_failed_replay(tmp_path: Path) -> None:
    """A one-off wrong gradient on rank 2's own step (its replays are right) fails exactly one
    comparison, rank 0's replay of rank 2 (group 0 replays group 1): ambiguous between the two
    until rank 4, in the third replica group, recomputes the same microbatch and sides with
    rank 0."""
    inject = {"SLURM_GUARD_INJECT": "kind=grad-scale,rank=2,step=2"}  # step 2 is replayed
    outcomes = run_local(
        train_three_groups, 6, args=(str(tmp_path), 3), nodes=SIX, extra_env=inject
    )
    alarm = _alarms(outcomes)[0]
    assert (alarm["check"], alarm["step"], alarm["update_applied"]) == ("replay", 2, False)
    assert alarm["verdict"] == "sdc"  # without the settling round: ambiguous, ranks 0 and 2
    assert alarm["suspect_ranks"] == [2] and alarm["suspect_nodes"] == ["n2"]
    assert alarm["last_verified_step"] == 0


@pytest.mark.distributed
def test_with_three_replica_groups_the_vote_names_the_odd_copy(tmp_path: Path) -> None:
    inject = {"SLURM_GUARD_INJECT": "kind=weight-bitflip,rank=3,step=1,bit=30"}
    outcomes = run_local(
        train_three_groups, 6, args=(str(tmp_path), 2), nodes=SIX, extra_env=inject
    )
    alarm = _alarms(outcomes)[0]
    assert (alarm["check"], alarm["step"], alarm["update_applied"]) == ("vote", 1, True)
    # two groups could only say that shard 1's copies differ; the third names the bad one
    assert alarm["verdict"] == "sdc" and alarm["suspect_ranks"] == [3]
    assert alarm["suspect_nodes"] == ["n3"]


@pytest.mark.distributed
def test_one_shard_per_replica_group_is_refused_by_name(tmp_path: Path) -> None:
    """A 3x1 mesh: FSDP2 copies instead of reduce-scattering, so the guard's check never runs;
    every rank refuses at set-up (it failed on the first step with a misleading message)."""
    outcomes = run_local(train_three_groups, 3, args=(str(tmp_path), 1), nodes=NODES[:3])
    assert [o.status for o in outcomes] == ["error"] * 3
    assert all("2 or more shards per replica group" in str(o.value) for o in outcomes)
