"""Directories on a node that no other user can touch: the one place that creates and checks them.

Snapshots are the first state slurm-guard keeps outside the run directory, in node-local memory
(/dev/shm) or a node-local disk that other users' jobs share. So every path there is treated as
hostile until checked, the way OpenSSH's `safe_path` checks a key file: walking from `/` down,
each component must be a directory owned by root or by this user, and one that others can write
must have the sticky bit (then no one else can rename or delete what this user owns in it). The
private root itself belongs to this user alone (0700), everything below it is created 0700
(directories) or 0600 (files) and opened without following a link (`O_NOFOLLOW`, checked with
`fstat`). A path that fails a check is never used; the error names the component and the fix.

Root code (the node epilog, `rundir.node_epilog`) removes what a job left through directory
descriptors (`remove_tree_at`, which never follows a link) and only what the job's user
owns. Torch-free: the epilog imports this module.
"""

from __future__ import annotations

import errno
import logging
import os
import pwd
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = [
    "UnsafePath",
    "check_private_dir",
    "create_private_file",
    "ensure_private_root",
    "list_private_dirs",
    "open_private_file",
    "owner_name",
    "private_subdir",
    "remove_owned_dirs",
    "remove_tree_at",
]

DIR_MODE = 0o700
FILE_MODE = 0o600


class UnsafePath(OSError):
    """A node-local path another user could read, replace or redirect: never used."""


def owner_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _check_component(path: Path, st: os.stat_result, uid: int, last: bool) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(errno.ENOTDIR, "not a directory", str(path))
    if st.st_uid not in (0, uid):
        raise UnsafePath(
            errno.EPERM,
            f"belongs to {owner_name(st.st_uid)}, who could replace what is in it; remove it "
            "(as that user or root) or choose another snapshot_dir",
            str(path),
        )
    others_write = st.st_mode & 0o022
    if not last and others_write and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(
            errno.EPERM,
            f"can be written by other users (mode {stat.S_IMODE(st.st_mode):04o}, no sticky "
            "bit), who could replace what is in it; chmod o-w,g-w (or +t) it or choose another "
            "snapshot_dir",
            str(path),
        )


def _checked_ancestor(current: Path, uid: int) -> None:
    """One directory above the private root: root's or `uid`'s, sticky where others can write.

    A symbolic link is followed only when root owns it (/dev/shm -> /run/shm on some systems);
    its target is then checked like any other component.
    """
    st = os.lstat(current)
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid != 0:
            raise UnsafePath(
                errno.ELOOP,
                f"is a symbolic link owned by {owner_name(st.st_uid)}; remove it or choose "
                "another snapshot_dir",
                str(current),
            )
        st = os.stat(current)
    _check_component(current, st, uid, last=False)


def ensure_private_root(path: Path, uid: int | None = None) -> Path:
    """`path` as this user's private directory: created 0700 if missing, else checked.

    Walks from `/` down: each directory above it is checked before the next is looked at, and
    one that is missing is created 0700. The root itself must be this user's; if others may
    read it, it is tightened to 0700 (through a descriptor, never a link). Raises UnsafePath
    (an OSError) naming the component that fails and the fix.
    """
    uid = os.geteuid() if uid is None else uid
    path = Path(os.path.abspath(path))
    if path == Path(path.anchor):
        raise UnsafePath(errno.EINVAL, "not a usable snapshot directory", str(path))
    current = Path(path.anchor)
    for name in path.parts[1:]:
        current = current / name
        if not os.path.lexists(current):
            with suppress(FileExistsError):  # made by someone else meanwhile: checked below
                os.mkdir(current, DIR_MODE)
        if current != path:
            _checked_ancestor(current, uid)
    fd = _open_dir(path)
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise UnsafePath(
                errno.EPERM,
                f"belongs to {owner_name(st.st_uid)}, not to {owner_name(uid)}; remove it (as "
                "that user or root) or choose another snapshot_dir",
                str(path),
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            logger.warning("%s was mode %04o: made private (0700)", path, stat.S_IMODE(st.st_mode))
            os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)
    return path


def _open_dir(path: Path, dir_fd: int | None = None) -> int:
    """A descriptor on directory `path` (relative to `dir_fd` if given), never through a link."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePath(
                exc.errno, "is a symbolic link or not a directory", str(path)
            ) from None
        raise


def check_private_dir(path: Path, uid: int | None = None) -> os.stat_result:
    """A directory below a private root: ours, not a link, no one else may write it."""
    uid = os.geteuid() if uid is None else uid
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(errno.ENOTDIR, "is a symbolic link or not a directory", str(path))
    if st.st_uid != uid or st.st_mode & 0o022:
        raise UnsafePath(
            errno.EPERM,
            f"belongs to {owner_name(st.st_uid)} with mode {stat.S_IMODE(st.st_mode):04o}, "
            "not to this user alone",
            str(path),
        )
    return st


def private_subdir(parent: Path, name: str, *, create: bool) -> Path:
    """`parent/name` created 0700 (when `create`) and checked; `parent` was checked already."""
    path = parent / name
    if create:
        with suppress(FileExistsError):
            os.mkdir(path, DIR_MODE)
    check_private_dir(path)
    return path


def list_private_dirs(directory: Path) -> list[str]:
    """The names of the subdirectories of `directory` that pass `check_private_dir`; entries
    that do not (a link, another user's) are left out with a warning."""
    names = []
    for entry in os.scandir(directory):
        try:
            check_private_dir(Path(entry.path))
        except UnsafePath as exc:
            logger.warning("ignoring %s: %s", entry.path, exc.strerror)
            continue
        except OSError:
            continue  # gone between listing and checking
        names.append(entry.name)
    return names


def create_private_file(path: Path) -> int:
    """A new file `path`, 0600, never through a link and never an existing file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, FILE_MODE)


@contextmanager
def open_private_file(path: Path) -> Iterator[int]:
    """A descriptor to read `path` only if it is a regular file of this user's that no one
    else may write; never through a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(errno.EINVAL, "not a regular file", str(path))
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise UnsafePath(
                errno.EPERM, f"belongs to {owner_name(st.st_uid)}, not to this user", str(path)
            )
        os.set_blocking(fd, True)
        yield fd
    finally:
        os.close(fd)


def remove_tree_at(dir_fd: int, name: str) -> None:
    """Remove directory `name` in `dir_fd` and everything in it, through descriptors only.

    Each directory is opened with O_NOFOLLOW relative to its parent's descriptor, so a link is
    unlinked, never followed, even one swapped in meanwhile (the open then fails). What
    `shutil.rmtree(dir_fd=...)` does on Python 3.11+, here for 3.10 too.
    """
    fd = _open_dir(Path(name), dir_fd=dir_fd)
    try:
        for entry in os.scandir(fd):
            if entry.is_dir(follow_symlinks=False):
                remove_tree_at(fd, entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def remove_owned_dirs(root: Path, uid: int, wanted: str) -> tuple[list[str], list[str]]:
    """Remove the directories in `root` named `wanted` or `wanted-*` that `uid` owns.

    For root code: `root` itself must be a directory `uid` owns, reached without following a
    link in its last component (the directories above it are the site's configuration); nothing
    below it is ever followed (`remove_tree_at`). Returns (removed, refused
    with why). Raises OSError when `root` cannot be opened or is not `uid`'s.
    """
    parent_fd = os.open(root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        root_fd = _open_dir(Path(root.name), dir_fd=parent_fd)
    finally:
        os.close(parent_fd)
    removed: list[str] = []
    refused: list[str] = []
    try:
        owner = os.fstat(root_fd).st_uid
        if owner != uid:
            raise UnsafePath(
                errno.EPERM, f"belongs to {owner_name(owner)}, not the job's user", str(root)
            )
        for name in os.listdir(root_fd):
            if name != wanted and not name.startswith(f"{wanted}-"):
                continue
            st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                refused.append(f"{root / name}: not a directory (a link is never followed)")
            elif st.st_uid != uid:
                refused.append(f"{root / name}: belongs to {owner_name(st.st_uid)}")
            else:
                remove_tree_at(root_fd, name)
                removed.append(str(root / name))
    finally:
        os.close(root_fd)
    return removed, refused
