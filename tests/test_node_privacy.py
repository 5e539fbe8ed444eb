"""One node, two users: snapshots no one else can touch, an epilog safe as root, room first.

Issue 42, findings 1-5, played with real accounts made here (`useradd`: alice the victim,
mallory the attacker, each action run as that user) on a fresh tmpfs mounted on /dev/shm in a
private mount namespace (`unshare -m`): `tests/node_privacy_workers.py` holds the scenarios.
Needs root (CI runs as root); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "node_privacy_workers.py"
ALICE, MALLORY = "sg-alice", "sg-mallory"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("useradd") is None,
    reason="needs root, unshare and useradd (real accounts, a private mount namespace)",
)


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, int]]:
    made = []
    for name in (ALICE, MALLORY):
        if subprocess.run(["id", "-u", name], capture_output=True).returncode != 0:
            subprocess.run(
                ["useradd", "--no-create-home", "--user-group", "-s", "/usr/sbin/nologin", name],
                check=True,
            )
            made.append(name)
    uids = {
        name: int(subprocess.run(["id", "-u", name], capture_output=True, text=True).stdout)
        for name in (ALICE, MALLORY)
    }
    yield uids
    for name in made:
        subprocess.run(["userdel", name], check=False)


def _scenario(name: str, *args: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    command = ["unshare", "-m", "--propagation", "private", sys.executable, str(WORKERS)]
    done = subprocess.run(
        [*command, name, ALICE, MALLORY, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_root_another_user_made_or_linked_is_never_used(users: dict[str, int]) -> None:
    """Finding 1: mallory makes /dev/shm/slurm-guard (and alice's own root name) 0777 first;
    alice's snapshots never go inside, and one warning names the directory and the fix."""
    squat = _scenario("squat")
    assert squat["alice_in_mallorys"] == [], "alice's snapshot went into mallory's directory"
    assert squat["written"] == 0 and squat["failed"] == 2
    [warning] = squat["warnings"]  # one, not one per snapshot
    assert f"/dev/shm/slurm-guard-{users[ALICE]}" in warning and MALLORY in warning
    assert "remove it" in warning and "snapshot_dir" in warning
    link = _scenario("link")
    assert link["in_mallorys"] == [] and link["written"] == 0
    assert "symbolic link" in link["warnings"][0]


def test_snapshots_are_private_to_their_user(users: dict[str, int]) -> None:
    """Finding 2: directories 0700, files 0600, all alice's; mallory can neither list nor read."""
    result = _scenario("private")
    assert result["written"] == 1 and result["root_mode"] == "0700"
    assert result["modes"], "nothing written"
    for path, owner, mode in result["modes"]:
        assert owner == users[ALICE], path
        assert mode == ("0600" if path.endswith((".pt", ".json")) else "0700"), (path, mode)
    assert set(result["mallory"].values()) == {"PermissionError"}, result["mallory"]


def test_the_second_user_of_a_node_gets_snapshots(users: dict[str, int]) -> None:
    """Finding 3: after mallory's snapshot job and its epilog, alice's snapshots are written."""
    result = _scenario("second_user")
    assert result["epilog"]["rc"] == 0
    assert result["written"] == 2 and result["failed"] == 0, result["last_error"]
    assert result["kept"][-1] == [20, 10]


def test_the_node_epilog_never_follows_a_link_nor_removes_another_user_s_files(
    users: dict[str, int], tmp_path: Path
) -> None:
    """Finding 4: mallory links /dev/shm/slurm-guard(-<uid>) to alice's runs dir; the epilog of
    alice's job (root) removes nothing there. In alice's own root it removes her job's
    directories only, and neither her links to root's files nor a root mallory made for her."""
    runs = tmp_path / "alice-runs"
    result = _scenario("planted_links", str(runs))
    assert result["alice_runs_kept"], f"the epilog deleted alice's run dir: {result['first']}"
    assert result["first"]["rc"] == result["second"]["rc"] == result["third"]["rc"] == 0
    assert "symbolic link" in result["first"]["stderr"]
    assert result["precious_kept"]
    assert result["left_in_root"] == ["555-evil", "556-0123456789abcdef"]
    assert "removed" in result["second"]["stderr"]
    assert result["mallorys_kept"] and "not the job's user" in result["third"]["stderr"]


def test_room_first_keeps_the_newest_snapshots_when_memory_is_tight(
    users: dict[str, int],
) -> None:
    """Finding 5: with room for 2.5 snapshots the oldest goes before the third write (newest two
    kept), with room for 1.5 the newest one is kept, and with less a failed write says so."""
    result = _scenario("room")
    assert result["probe"] == 1
    assert result["room_2_5"]["kept"] == [[5], [10, 5], [15, 10], [20, 15]]
    assert result["room_1_5"]["kept"] == [[5], [10], [15], [20]]
    tight = result["room_0_5"]
    assert tight["written"] == 0 and "no space left in /dev/shm/room_0_5/sg" in tight["last_error"]
    assert "inline_container" not in tight["last_error"]
