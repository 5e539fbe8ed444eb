"""Reading a run directory's alarms as untrusted input, and finding the run directory of a job.

The controller runs as SlurmUser/root and reads files a user's job wrote. Each alarm file is
read through `records.read_alarm` (bounded size, no symlinks, schema checked); on top of that we
keep the file's owner, because only the job's own user may raise its alarms.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from slurm_guard.protocol import COMMENT_KEY
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import Alarm, RecordError, read_alarm, read_json_file

"""The launcher sets the job comment to this followed by the run directory's absolute path."""
MAX_ALARM_FILES = 1000  # a run raises a handful; thousands means something is wrong


@dataclass(frozen=True)
class AlarmFile:
    path: Path
    alarm: Alarm
    owner_uid: int


@dataclass(frozen=True)
class BadAlarmFile:
    path: Path
    error: str
    fingerprint: str  # path + size + mtime: report each broken file once, not every scan


def unreadable(path: Path, exc: OSError) -> BadAlarmFile:
    """A file or directory the controller may not read, with what to do about it."""
    try:
        st = os.lstat(path)
        fingerprint = f"{path}:unreadable:{st.st_mode:o}:{st.st_uid}:{st.st_mtime_ns}"
    except OSError:
        fingerprint = f"{path}:unreadable:{exc.errno}"
    return BadAlarmFile(
        path,
        f"{path}: cannot read ({exc.strerror or exc}) as uid {os.geteuid()}; alarms in it "
        "are not acted on. Make run directories and their records readable by the "
        "controller's user (e.g. umask 022 in the job), or run the controller as that user",
        fingerprint,
    )


def read_alarm_files(run_dir: Path) -> tuple[list[AlarmFile], list[BadAlarmFile]]:
    """Every alarm of a run directory, oldest first, and every file that could not be used.

    Never raises for what a user can do to their run directory (unreadable files and
    directories included): each such problem is one BadAlarmFile, the rest is still read.
    """
    rd = RunDir(run_dir)
    good: list[AlarmFile] = []
    bad: list[BadAlarmFile] = []
    alarms_dir = rd.alarms_dir
    try:
        st = os.lstat(alarms_dir)
    except FileNotFoundError:
        return good, bad
    except OSError as exc:
        return good, [unreadable(alarms_dir, exc)]
    if not stat.S_ISDIR(st.st_mode):
        bad.append(
            BadAlarmFile(alarms_dir, f"{alarms_dir}: not a directory (a symlink?)", str(alarms_dir))
        )
        return good, bad
    try:
        # Not Path.glob: it hides an unreadable directory behind an empty listing.
        names = sorted(n for n in os.listdir(alarms_dir) if n.endswith(".json"))
    except FileNotFoundError:
        return good, bad
    except OSError as exc:
        return good, [unreadable(alarms_dir, exc)]
    for path in (alarms_dir / n for n in names[:MAX_ALARM_FILES]):
        try:
            fst = os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            bad.append(unreadable(path, exc))
            continue
        fingerprint = f"{path}:{fst.st_size}:{fst.st_mtime_ns}"
        try:
            alarm = read_alarm(path)
        except RecordError as exc:
            bad.append(BadAlarmFile(path, str(exc), fingerprint))
            continue
        except OSError as exc:
            bad.append(unreadable(path, exc))
            continue
        if alarm.alarm_id != path.stem:
            bad.append(
                BadAlarmFile(
                    path,
                    f"{path}: alarm_id {alarm.alarm_id!r} does not match the file name; "
                    "alarm files are named <alarm_id>.json",
                    fingerprint,
                )
            )
            continue
        good.append(AlarmFile(path, alarm, fst.st_uid))
    good.sort(key=lambda f: (f.alarm.created, f.alarm.step))
    return good, bad


def run_dir_from_comment(comment: str | None) -> Path | None:
    """The run directory named in a job comment `slurm-guard:run_dir=/abs/path`, if any."""
    if not comment:
        return None
    for part in comment.split(","):
        part = part.strip()
        if part.startswith(COMMENT_KEY):
            path = Path(part[len(COMMENT_KEY) :])
            if path.is_absolute() and ".." not in path.parts:
                return path
    return None


def iter_run_dirs(
    runs_root: Path,
    depth: int = 2,
    on_error: Callable[[Path, OSError], None] | None = None,
) -> Iterator[Path]:
    """Run directories (a `run.json` or an `alarms/` inside) at most `depth` levels below.

    A directory that cannot be listed or looked into is passed to `on_error` (the watcher
    reports it) and skipped; the walk goes on with the others.
    """
    level = [runs_root]
    for _ in range(depth):
        nxt: list[Path] = []
        for d in level:
            try:
                with os.scandir(d) as entries:
                    children = sorted(
                        Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)
                    )
            except OSError as exc:
                if on_error is not None:
                    on_error(d, exc)
                continue
            for child in children:
                try:
                    is_run = _is(child / "run.json", stat.S_ISREG) or _is(
                        child / "alarms", stat.S_ISDIR
                    )
                except OSError as exc:
                    if on_error is not None:
                        on_error(child, exc)
                    continue
                if is_run:
                    yield child
                else:
                    nxt.append(child)
        level = nxt


def _is(path: Path, kind: Callable[[int], bool]) -> bool:
    """Like Path.is_file/is_dir, but "permission denied" raises instead of reading as "no"."""
    try:
        return kind(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def job_failed(exit_code2: str | None) -> bool:
    """Whether a job ended badly, from EpilogSlurmctld's SLURM_JOB_EXIT_CODE2 ("exit:signal").

    Any non-zero exit status or signal counts, not only the guard's own exit code: with
    `srun --kill-on-bad-exit=1` the other ranks are killed when the first exits 86, and the
    job usually ends with 143 (SIGTERM) or a signal instead. Missing or unreadable counts as
    failed: looking costs a directory scan, missing an alarm costs a node that stays in use.
    """
    exit_code, _, signal = (exit_code2 or "").strip().partition(":")
    try:
        return int(exit_code) != 0 or int(signal or "0") != 0
    except ValueError:
        return True


def run_dir_job_ids(run_dir: Path) -> set[str]:
    """Job ids a run directory refers to: run.json's and every alarm's."""
    ids: set[str] = set()
    try:
        run = read_json_file(RunDir(run_dir).run_file)
        if isinstance(run, dict) and run.get("job_id") is not None:
            ids.add(str(run["job_id"]))
    except RecordError:
        pass
    good, _ = read_alarm_files(run_dir)
    ids.update(f.alarm.job_id for f in good if f.alarm.job_id is not None)
    return ids


def find_run_dir(
    job_id: str, comment: str | None, runs_root: Path | None
) -> tuple[Path | None, str]:
    """Where a job's run directory is, and how we know (for the log).

    Primary: the job comment, which only the job's owner (or an admin) can set, so Slurm
    itself vouches for the job -> run-dir link. Fallback: a run directory under the configured
    runs root whose run.json or alarms name the job.
    """
    from_comment = run_dir_from_comment(comment)
    if from_comment is not None:
        return from_comment, "job comment"
    if runs_root is not None and runs_root.is_dir():
        for run_dir in iter_run_dirs(runs_root):
            if job_id in run_dir_job_ids(run_dir):
                return run_dir, f"runs root {runs_root}"
    return None, "no slurm-guard comment on the job and no run dir under the runs root names it"
