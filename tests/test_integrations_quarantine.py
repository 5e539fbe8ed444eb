"""The framework integrations' quarantine on real files: a checkpoint and its seal move, never
over what is already there (integrations/_frameworks.quarantine; no framework needed)."""

from __future__ import annotations

from pathlib import Path

from slurm_guard.integrations._frameworks import Listed, quarantine


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
