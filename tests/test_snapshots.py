"""Node-local snapshots: sealed, kept two deep, and never loaded when damaged or foreign.

Real files in a temporary directory standing in for /dev/shm, real torch state, the real
background writer. The training step's side is simulated by changing the tensors in place right
after a snapshot starts: the snapshot must hold the values from before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from slurm_guard.core.snapshot_copy import SnapshotCopier
from slurm_guard.rundir.snapshots import (
    OWN_FILE,
    SEAL_FILE,
    WEIGHTS_FILE,
    SnapshotStore,
    remove_job_snapshots,
    snapshot_root,
)

RUN = "run-a"


def _state(seed: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8, generator=gen)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": {"cpu": torch.get_rng_state()},
        "stateful": {"sampler": {"epoch": 3, "order": [3, 1, 2]}},
    }


def _seal(step: int) -> dict[str, object]:
    return {
        "step": step,
        "run_id": RUN,
        "weight_fingerprint": f"fp{step}",
        "fingerprint_seed": 7,
        "world_size": 2,
    }


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b) and a.dtype == b.dtype
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return a == b


def test_a_snapshot_loads_back_bit_identical_and_only_the_newest_two_are_kept(
    tmp_path: Path,
) -> None:
    store = SnapshotStore(tmp_path, "1234", rank=1)
    states = {step: _state(step) for step in (10, 20, 30)}
    for step, state in states.items():
        store.write(state, **_seal(step))  # type: ignore[arg-type]
    seals, unusable = store.seals()
    assert [s.step for s in seals] == [30, 20] and unusable == {}
    assert sorted(p.name for p in store.directory.iterdir()) == ["step-00000020", "step-00000030"]
    for seal in seals:
        assert store.problem(seal, RUN) is None
        assert _equal(store.load(seal), states[seal.step])


def test_a_flipped_byte_or_an_edited_seal_is_never_loaded(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, "1234", rank=0)
    store.write(_state(1), **_seal(10))  # type: ignore[arg-type]
    store.write(_state(2), **_seal(20))  # type: ignore[arg-type]
    state_file = store.path(20) / OWN_FILE
    data = bytearray(state_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    state_file.write_bytes(bytes(data))
    seals, _ = store.seals()
    newest = seals[0]
    assert newest.step == 20
    assert "own.pt does not match its sealed sha256" in str(store.problem(newest, RUN))
    # weights.pt is not hashed: the loaded state must reproduce the sealed (the vote's)
    # fingerprint, which catches its damage (tests/test_snapshot_resume.py)
    assert newest.files[WEIGHTS_FILE] == "" and store.problem(newest, RUN, (WEIGHTS_FILE,)) is None
    assert store.problem(seals[1], RUN) is None  # the older one is still usable

    seal_file = store.path(10) / SEAL_FILE
    edited = json.loads(seal_file.read_text())
    edited["step"] = 20  # a seal moved to claim a newer step
    seal_file.write_text(json.dumps(edited))
    seals, unusable = store.seals()
    assert [s.step for s in seals] == [20] and "its seal says step 20" in unusable[10]

    (store.path(20) / SEAL_FILE).write_text("{not json")
    seals, unusable = store.seals()
    assert seals == [] and 20 in unusable


def test_a_snapshot_of_another_run_is_refused_by_name(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, "1234", rank=0)
    seal = store.write(_state(1), **_seal(10))  # type: ignore[arg-type]
    assert "sealed by another run (run-a, this run is run-b)" in str(store.problem(seal, "run-b"))


def test_the_copier_holds_the_state_of_its_step_while_training_goes_on(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, "77", rank=0)
    copier = SnapshotCopier(store, torch.device("cpu"))
    state = _state(5)
    before = {k: v.clone() for k, v in state["model"].items()}  # type: ignore[attr-defined]
    copier.start(state, **_seal(10))
    for tensor in state["model"].values():  # type: ignore[attr-defined]
        tensor.add_(1.0)  # the next step's update, in place, while the snapshot is written
    copier.start(state, **_seal(20))  # waits for the first: the store is written in order
    copier.close()
    assert copier.stats.written == 2 and copier.stats.failed == 0
    seals, _ = store.seals()
    first = store.load(next(s for s in seals if s.step == 10))
    assert _equal(first["model"], before)
    second = store.load(next(s for s in seals if s.step == 20))
    assert _equal(second["model"], state["model"])
    assert copier.stats.bytes > 0


def test_a_snapshot_that_cannot_be_written_is_dropped_with_the_reason(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    copier = SnapshotCopier(SnapshotStore(blocked, "77", rank=0), torch.device("cpu"))
    copier.start(_state(1), **_seal(10))
    copier.close()
    assert copier.stats.failed == 1 and copier.stats.written == 0
    assert copier.last_error is not None and copier.last_seal is None


def test_the_job_directory_is_removed_and_the_root_is_configurable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    SnapshotStore(tmp_path, "55", rank=0).write(_state(1), **_seal(10))  # type: ignore[arg-type]
    assert remove_job_snapshots(tmp_path, "55") and not (tmp_path / "55").exists()
    assert not remove_job_snapshots(tmp_path, "55")
    with pytest.raises(ValueError, match="job id"):
        SnapshotStore(tmp_path, "../etc", rank=0)
    monkeypatch.setenv("SLURM_GUARD_SNAPSHOT_DIR", str(tmp_path))
    assert snapshot_root() == tmp_path and snapshot_root("/x") == Path("/x")
    monkeypatch.delenv("SLURM_GUARD_SNAPSHOT_DIR")
    assert snapshot_root() == Path(f"/dev/shm/slurm-guard-{os.geteuid()}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_copy_reads_the_state_before_the_next_update(tmp_path: Path) -> None:
    device = torch.device("cuda")
    weight = torch.randn(1 << 22, device=device)
    before = weight.cpu()
    copier = SnapshotCopier(SnapshotStore(tmp_path, "77", rank=0), device)
    copier.start({"model": {"weight": weight}}, **_seal(10))
    copier.fence()  # what the guard does before the optimizer step
    weight.mul_(3.0)  # the update, on the training stream, after the fence
    copier.close()
    seals, _ = SnapshotStore(tmp_path, "77", rank=0).seals()
    saved = SnapshotStore(tmp_path, "77", rank=0).load(seals[0])
    assert torch.equal(saved["model"]["weight"], before)


@pytest.mark.distributed
def test_an_empty_peer_copy_travels_as_its_size_and_the_rest_arrive_whole() -> None:
    from workers import exchange_payloads

    from slurm_guard.local.launch import run_local

    outcomes = run_local(exchange_payloads, 3)
    assert [o.status for o in outcomes] == ["ok"] * 3, [o.value for o in outcomes]
    assert [o.value for o in outcomes] == [{}, {0: b""}, {0: bytes(range(256)) * 3}]
