"""The framework integrations' quarantine on real files: a checkpoint and its seal move, never
over what is already there (integrations/_frameworks.quarantine; no framework needed); and the
run directory's pointers to sealed framework checkpoints (rundir/seals)."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_guard.integrations._frameworks import Listed, quarantine
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.seals import Seal, located_checkpoints, newest_located, record_location


def _ckpt(folder: Path, name: str, text: str) -> Listed:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    seal = folder / f"{name}.slurm-guard.json"
    seal.write_text(f"seal of {text}")
    return Listed(6, folder / name, seal)


def test_two_folders_with_the_same_names_keep_both_checkpoints_and_their_seals(
    tmp_path: Path,
) -> None:
    """Two Lightning ModelCheckpoints both write `last.ckpt`: the second must not overwrite
    the first in quarantine (it did: os.replace onto the same name)."""
    target = tmp_path / "quarantine" / "alarm-1"
    first = quarantine(_ckpt(tmp_path / "a", "last.ckpt", "a"), target)
    second = quarantine(_ckpt(tmp_path / "b", "last.ckpt", "b"), target)
    assert first != second
    assert (first.read_text(), second.read_text()) == ("a", "b")
    for moved, text in ((first, "a"), (second, "b")):
        seal = moved.with_name(moved.name + ".slurm-guard.json")
        assert seal.read_text() == f"seal of {text}"  # still a pair
    assert not (tmp_path / "a" / "last.ckpt").exists()


def test_a_folder_checkpoint_moves_with_the_seal_inside_it(tmp_path: Path) -> None:
    """HF's checkpoint-N/ holds its seal: one move."""
    folder = tmp_path / "out" / "checkpoint-6"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_text("w")
    (folder / "slurm_guard.json").write_text("seal")
    moved = quarantine(Listed(6, folder, folder / "slurm_guard.json"), tmp_path / "q")
    assert moved == tmp_path / "q" / "checkpoint-6"
    assert (moved / "slurm_guard.json").read_text() == "seal" and not folder.exists()


def _sealed(run_dir: RunDir, path: Path, step: int) -> None:
    """A framework checkpoint sealed as rank 0 seals one: the seal beside it, its location in
    the run directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"weights of step {step}")
    seal = Seal(step, f"{step:016x}", 7, "run-a", {path.name: "0" * 64}, str(path))
    sealed = seal.as_json(restart_count=0, world_size=3)
    seal_file = path.with_name(path.name + ".slurm-guard.json")
    seal_file.write_text(json.dumps(sealed))
    record_location(run_dir, sealed, seal_file, "lightning")


def test_the_run_directory_points_at_sealed_checkpoints_only_while_their_seal_says_so(
    tmp_path: Path,
) -> None:
    """What the alarm, `status` and a Lightning rerun read: a checkpoint moved to quarantine,
    deleted by rotation, or a `last.ckpt` sealed again at another step is not pointed at."""
    run_dir = RunDir(tmp_path / "run")
    v0 = tmp_path / "logs" / "version_0" / "checkpoints"
    _sealed(run_dir, v0 / "epoch=0-step=3.ckpt", 3)
    _sealed(run_dir, v0 / "epoch=1-step=6.ckpt", 6)
    _sealed(run_dir, v0 / "last.ckpt", 6)
    found = located_checkpoints(run_dir)
    assert [(c.step, c.path.name) for c in found] == [
        (6, "epoch=1-step=6.ckpt"),  # at one step, the named file before last.ckpt
        (6, "last.ckpt"),
        (3, "epoch=0-step=3.ckpt"),
    ]
    assert newest_located(run_dir, 5, "run-a") == found[2]
    assert newest_located(run_dir, 5, "run-b") is None  # another run's: never trusted
    assert newest_located(run_dir, 2, "run-a") is None
    six = found[0]
    quarantine(Listed(6, six.path, six.seal_path), tmp_path / "logs" / "q")
    _sealed(run_dir, v0 / "last.ckpt", 9)  # written again: one record per location
    assert [(c.step, c.path.name) for c in located_checkpoints(run_dir)] == [
        (9, "last.ckpt"),
        (3, "epoch=0-step=3.ckpt"),
    ]
