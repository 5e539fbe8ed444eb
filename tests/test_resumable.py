"""`sg.resumable`: the epoch loop over a DataLoader that a resume re-enters mid-epoch (issue 43)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from effects_workers import epoch_loop
from torch.utils.data import DataLoader, TensorDataset

import slurm_guard as sg
from slurm_guard.local.launch import run_local

NODES = ["node1", "node2", "node3"]


def _values(outcomes: list[Any]) -> list[dict[str, Any]]:
    assert [o.status for o in outcomes] == ["ok"] * len(outcomes), [o.value for o in outcomes]
    return [o.value for o in outcomes]


class Counting(TensorDataset):
    """Counts the samples it loads: a resume must not load the batches it skips."""

    loaded = 0

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        Counting.loaded += 1
        return tuple(t[i] for t in self.tensors)


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_resume_skips_by_index_and_sees_the_same_batches(drop_last: bool) -> None:
    data = Counting(torch.arange(10))
    loader = DataLoader(data, batch_size=3, shuffle=True, drop_last=drop_last)
    clean = [(s, b[0].tolist()) for s, b in sg.resumable(loader, 0, steps=9)]
    torch.manual_seed(1234)  # the global RNG differs at the resume: the batches must not
    before = torch.get_rng_state()
    Counting.loaded = 0
    resumed = [(s, b[0].tolist()) for s, b in sg.resumable(loader, 5, steps=9)]
    assert resumed == clean[5:]
    assert Counting.loaded == sum(len(b) for _, b in resumed)  # nothing skipped was loaded
    assert torch.equal(torch.get_rng_state(), before)  # no draw from the training RNG
    assert [s for s, _ in clean] == list(range(9))


def test_a_loader_without_a_length_is_refused_by_name() -> None:
    with pytest.raises(sg.GuardError, match="length"):
        next(sg.resumable(iter([1, 2]), 0))


@pytest.mark.distributed
@pytest.mark.parametrize(("workers", "drop_last"), [(0, False), (2, True)])
def test_epoch_loop_with_a_fault_on_node2_resumes_mid_epoch_bit_identical(
    tmp_path: Path, workers: int, drop_last: bool
) -> None:
    """DistributedSampler(shuffle=True), dropout, saves at epoch ends and every 3 steps: a
    persistent fault on node2 at step 7 stops the run; the resume starts mid-epoch (step 6,
    offset 6 % per_epoch) and ends bit-identical to a run without the fault, with no warning
    that the data differs."""
    steps = 11
    clean_dir, faulty_dir = tmp_path / "clean", tmp_path / "faulty"
    clean_dir.mkdir()
    faulty_dir.mkdir()
    clean = _values(run_local(epoch_loop, 3, (str(clean_dir), steps, workers, drop_last), NODES))
    per_epoch = clean[0]["per_epoch"]
    assert per_epoch == (4 if drop_last else 5)
    fault = (sg.Fault("grad-scale", node="node2", step=7, persistent=True),)
    args = (str(faulty_dir), steps, workers, drop_last, fault)
    faulty = _values(run_local(epoch_loop, 3, args, NODES))
    assert all(r["alarm"] == "exit" for r in faulty)
    resumed = _values(run_local(epoch_loop, 3, (str(faulty_dir), steps, workers, drop_last), NODES))
    assert resumed[0]["start"] == 6 and 6 % per_epoch != 0  # mid-epoch
    assert resumed[0]["seen"] == list(range(6, steps))
    for a, b in zip(clean, resumed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"], strict=True))
    assert not any("data differs" in m for m in resumed[0]["logged"])


@pytest.mark.distributed
def test_an_unseeded_dataset_warns_on_resume_that_the_data_differs(tmp_path: Path) -> None:
    """A run stopped after step 7 (last checkpoint: step 6) resumes at 6; its dataset draws
    noise from an unseeded source, so step 6's batch differs: rank 0 warns once, naming the
    step and the likely cause."""
    _values(run_local(epoch_loop, 3, (str(tmp_path), 8, 0, False, (), True), NODES))
    resumed = _values(run_local(epoch_loop, 3, (str(tmp_path), 10, 0, False, (), True), NODES))
    assert resumed[0]["start"] == 6
    warnings = [m for m in resumed[0]["logged"] if "data differs" in m]
    assert len(warnings) == 1, resumed[0]["logged"]
    assert "at step 6" in warnings[0] and "unseeded dataset" in warnings[0]
    assert not any("data differs" in m for r in resumed[1:] for m in r["logged"])
