"""Scenarios of one node shared by two users, run as root inside a private mount namespace.

`tests/test_node_privacy.py` runs `unshare -m python tests/node_privacy_workers.py SCENARIO
ALICE MALLORY [DIR]`: this mounts a fresh tmpfs on /dev/shm (a node's memory, shared by every
user of the node, as without Slurm's job_container/tmpfs), then plays the victim (alice) and the
attacker (mallory) as those real accounts (a forked child that drops to their uid and gid), and
root's node epilog as root, on real files. The result is printed as one JSON line.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._weights_only_unpickler  # imported now: the users cannot reach it

from slurm_guard.core.snapshot_copy import SnapshotCopier
from slurm_guard.rundir.snapshots import SnapshotStore, snapshot_root

ROOT = Path(__file__).resolve().parents[1]
EPILOG = ROOT / "epilog" / "slurm-guard-node-epilog.sh"
SHM = Path("/dev/shm")


def as_user(user: str, fn: Callable[[], Any]) -> Any:
    """`fn()` in a forked child running as `user` (uid, gid, no other groups); its result."""
    entry = pwd.getpwnam(user)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            os.umask(0o022)
            out = {"ok": fn()}
        except BaseException as exc:
            out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        with os.fdopen(write, "w") as f:
            json.dump(out, f, default=str)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        data = f.read()
    os.waitpid(pid, 0)
    result = json.loads(data)
    if "error" in result:
        raise RuntimeError(f"as {user}: {result['error']}\n{result.get('trace', '')}")
    return result["ok"]


def attempt(fn: Callable[[], Any]) -> str:
    """What happened: 'ok' or the error's name (for the attacker's tries)."""
    try:
        fn()
        return "ok"
    except OSError as exc:
        return type(exc).__name__


def state(mib: float = 0.25) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(int(mib * 2**18), generator=gen)
    return {
        "model": {"weight": weight},
        "optimizer": {"state": {}, "param_groups": []},
        "rng": {"cpu": torch.get_rng_state()},
        "stateful": None,
    }


def seal(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "run_id": "0123456789abcdef",
        "weight_fingerprint": f"{step:016x}",
        "fingerprint_seed": 7,
        "world_size": 1,
    }


def write_snapshots(root: Path | None, key: str, steps: list[int], mib: float) -> dict[str, Any]:
    """Snapshots through the copier as the guard takes them; what was written, kept, warned."""
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("slurm_guard").addHandler(Collect())
    store = SnapshotStore(root if root is not None else snapshot_root(), key, rank=0)
    copier = SnapshotCopier(store, torch.device("cpu"))
    kept = []
    for step in steps:
        copier.start(state(mib), **seal(step))
        copier.wait()
        kept.append([s.step for s in store.seals()[0]])
    copier.close()
    return {
        "written": copier.stats.written,
        "failed": copier.stats.failed,
        "last_error": copier.last_error,
        "warnings": warnings,
        "kept": kept,
        "directory": str(store.directory),
        "root": str(store.root),
    }


def owners_below(path: Path) -> list[tuple[str, int, str]]:
    """(path, owner uid, mode) of everything below `path` (links not followed)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            st = os.lstat(Path(dirpath) / name)
            out.append((str(Path(dirpath) / name), st.st_uid, f"{stat.S_IMODE(st.st_mode):04o}"))
    return out


def epilog(job: str, uid: int, **extra: str) -> dict[str, Any]:
    env = {
        "SLURM_JOB_ID": job,
        "SLURM_JOB_UID": str(uid),
        "SLURM_GUARD_PYTHON": sys.executable,
        "SLURM_GUARD_DEFAULTS": "/nonexistent",
        "PYTHONPATH": str(ROOT),
        **extra,
    }
    done = subprocess.run(["sh", str(EPILOG)], env=env, capture_output=True, text=True)
    return {"rc": done.returncode, "stderr": done.stderr}


def squat(alice: str, mallory: str) -> dict[str, Any]:
    """mallory makes the snapshot roots first (0777), then alice snapshots."""
    uid = pwd.getpwnam(alice).pw_uid

    def plant() -> None:
        for path in (SHM / "slurm-guard", SHM / f"slurm-guard-{uid}"):
            path.mkdir()
            path.chmod(0o777)

    as_user(mallory, plant)
    result = as_user(alice, lambda: write_snapshots(None, "7-0123456789abcdef", [10, 20], 0.25))
    result["alice_in_mallorys"] = [
        p for d in ("slurm-guard", f"slurm-guard-{uid}") for p in owners_below(SHM / d)
    ]
    return result


def link(alice: str, mallory: str) -> dict[str, Any]:
    """mallory links the snapshot roots to a directory of hers, then alice snapshots."""
    uid = pwd.getpwnam(alice).pw_uid

    def plant() -> None:
        (SHM / "mallory").mkdir()
        (SHM / "mallory").chmod(0o777)
        for path in (SHM / "slurm-guard", SHM / f"slurm-guard-{uid}"):
            path.symlink_to(SHM / "mallory")

    as_user(mallory, plant)
    result = as_user(alice, lambda: write_snapshots(None, "7-0123456789abcdef", [10], 0.25))
    result["in_mallorys"] = owners_below(SHM / "mallory")
    return result


def private(alice: str, mallory: str) -> dict[str, Any]:
    """alice snapshots; what mallory can see of it."""
    result = as_user(alice, lambda: write_snapshots(None, "7-0123456789abcdef", [10], 0.25))
    root, step = Path(result["root"]), Path(result["directory"]) / "step-00000010"
    result["modes"] = owners_below(root)
    result["root_mode"] = f"{stat.S_IMODE(os.lstat(root).st_mode):04o}"

    def peek() -> dict[str, str]:
        return {
            "list root": attempt(lambda: os.listdir(root)),
            "read own.pt": attempt(lambda: (step / "own.pt").read_bytes()),
            "read weights.pt": attempt(lambda: (step / "weights.pt").read_bytes()),
            "read seal.json": attempt(lambda: (step / "seal.json").read_bytes()),
        }

    result["mallory"] = as_user(mallory, peek)
    return result


def second_user(alice: str, mallory: str) -> dict[str, Any]:
    """mallory's job snapshots and ends (the node epilog runs); then alice's job snapshots."""
    mallory_uid = pwd.getpwnam(mallory).pw_uid
    as_user(mallory, lambda: write_snapshots(None, "100", [10], 0.25))
    cleaned = epilog("100", mallory_uid)
    result = as_user(alice, lambda: write_snapshots(None, "101", [10, 20], 0.25))
    result["epilog"] = cleaned
    return result


def planted_links(alice: str, mallory: str, runs: str) -> dict[str, Any]:
    """The epilog, as root, after mallory linked the snapshot roots to alice's runs dir, and
    after alice linked entries of her own root to a directory of root's."""
    uid = pwd.getpwnam(alice).pw_uid
    job = "555"
    victim = Path(runs) / job / "checkpoints" / "step-00000010"
    victim.mkdir(parents=True)
    (victim / "model.pt").write_bytes(b"alice's weights")
    shutil.chown(Path(runs), uid)
    for dirpath, dirnames, filenames in os.walk(runs):
        for name in dirnames + filenames:
            shutil.chown(Path(dirpath) / name, uid)

    def plant() -> None:
        for path in (SHM / "slurm-guard", SHM / f"slurm-guard-{uid}"):
            path.symlink_to(runs)

    as_user(mallory, plant)
    first = epilog(job, uid)
    alice_runs_kept = (victim / "model.pt").exists()
    try:
        rest = _own_root_and_site(alice, mallory, job, uid)
    except RuntimeError as exc:  # reported beside the first part, which the test checks first
        rest = {"error": str(exc)}
    return {"first": first, "alice_runs_kept": alice_runs_kept, **rest}


def _own_root_and_site(alice: str, mallory: str, job: str, uid: int) -> dict[str, Any]:
    # now alice's own root, with links of hers to root's files in it
    os.unlink(SHM / f"slurm-guard-{uid}")
    precious = SHM / "precious"
    precious.mkdir()
    (precious / "keep").write_text("root's")

    def own_root() -> None:
        done = write_snapshots(None, f"{job}-0123456789abcdef", [10], 0.25)
        root = Path(done["root"])
        (root / f"{job}-evil").symlink_to(precious)
        (Path(done["directory"]) / "link").symlink_to(precious)
        write_snapshots(None, "556-0123456789abcdef", [10], 0.25)

    as_user(alice, own_root)
    second = epilog(job, uid)
    root = SHM / f"slurm-guard-{uid}"
    # a root another user made for alice's uid (site layout /dev/shm/site/<uid>)
    site = SHM / "site"
    site.mkdir()
    site.chmod(0o1777)

    def squat_site() -> None:
        (site / str(uid) / f"{job}-m").mkdir(parents=True)

    as_user(mallory, squat_site)
    third = epilog(job, uid, SLURM_GUARD_SNAPSHOT_DIR=str(site / "{uid}"))
    return {
        "second": second,
        "precious_kept": (precious / "keep").exists(),
        "left_in_root": sorted(os.listdir(root)),
        "third": third,
        "mallorys_kept": (site / str(uid) / f"{job}-m").is_dir(),
    }


def room(alice: str, mallory: str) -> dict[str, Any]:
    """Snapshots into tmpfs mounts with room for 2.5, 1.5 and 0.5 of them."""
    measure = SHM / "measure"
    probe = write_snapshots(measure, "9", [1], 1.0)
    size = sum(os.lstat(p).st_size for p, _, _ in owners_below(measure) if "step" in p)
    out: dict[str, Any] = {"snapshot_bytes": size, "probe": probe["written"]}
    for name, fits in (("room_2_5", 2.5), ("room_1_5", 1.5), ("room_0_5", 0.5)):
        mount = SHM / name
        mount.mkdir()
        pages = int(fits * size) // 4096 * 4096
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={pages}", "tmpfs", str(mount)], check=True
        )
        out[name] = write_snapshots(mount / "sg", "9", [5, 10, 15, 20], 1.0)
    return out


SCENARIOS = {
    "squat": squat,
    "link": link,
    "private": private,
    "second_user": second_user,
    "planted_links": planted_links,
    "room": room,
}


def main() -> None:
    name, alice, mallory, *rest = sys.argv[1:]
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m,mode=1777", "tmpfs", "/dev/shm"], check=True
    )
    buffer = io.BytesIO()  # the lazy parts of save and load, loaded before any user runs
    torch.save(state(0.01), buffer)
    torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    print(json.dumps(SCENARIOS[name](alice, mallory, *rest), default=str))


if __name__ == "__main__":
    main()
