"""Pure parsers for Slurm command output; no subprocess, so they are tested on recorded text.

Format notes (``scontrol show -o job|node``, one record per line)
------------------------------------------------------------------
A record is ``Key=value`` pairs separated by single or double spaces, but values may contain
spaces too (``JobName=my run``, ``OS=Linux 6.1 #1 SMP ...``, node ``Reason=...``) and ``=``
(``TRES=cpu=2,mem=1000M``). So we split only where a space is followed by a token that looks
like a Slurm key: an upper-case letter, then letters/digits/``_:/``, then ``=``
(``MCS_label=``, ``CPUs/Task=``, ``ReqB:S:C:T=``). Unknown keys are kept, so new fields in
newer Slurm releases do not break parsing.

The node ``Reason`` is free text written by admins and by slurm-guard itself, and may contain
``Key=value``-looking words (``slurm-guard: sdc Rank=3``). Slurm prints it as
``Reason=<text> [<user>@<time>]`` when the reason time is set (always, for reasons set with
``scontrol update``), so we cut it out first using that trailer; without the trailer it ends at
the next of the few keys Slurm prints after it (``Comment``, ``Extra``, ``InstanceId``,
``InstanceType``, ``ReservationName``) or at the end of the line. Job ``Reason`` never contains
spaces: Slurm replaces them with ``_`` ("job_requeued_in_held_state").

Differences 22.05 (recorded, ``tests/data/slurm-22.05``) vs 24.11 (from Slurm's
``src/api/node_info.c``/``job_info.c``; not recorded here):

* node: 24.11 drops ``CapWatts``, ``ExtSensorsJoules/Watts/Temp`` (power plugins were removed
  in 23.11) and prints ``CurrentWatts=n/a AveWatts=n/a``; adds ``ResumeAfterTime=`` after
  ``LastBusyTime=``, and optional lines after ``Reason``: ``Comment=``, ``Extra=``,
  ``InstanceId=``/``InstanceType=``, ``ReservationName=``, and ``RestrictedCoresPerGPU=``,
  ``GresDrain=``, ``GresUsed=``. A multi-line reason continues after 7 spaces.
* job: 24.11 drops ``Power=`` (last field on 22.05) and may add optional trailing fields
  (``MailUser= MailType=``, ``TresPerTask=``, ``NtasksPerTRES=``, ``Container=``...). The
  fields slurm-guard reads (JobId, JobName, UserId, JobState, Reason, Requeue, Restarts,
  ExitCode, ExcNodeList, NodeList, WorkDir, Priority) have the same form in both.
* node ``Reason``: 24.11 keeps it after ``scontrol update State=RESUME`` (the node reads
  ``State=IDLE ... Reason=... [user@time]``); 22.05 clears it. Only ``NodeInfo.effective_reason``
  (the reason while the node is drained, failing or down) means anything.
* ``State=`` for nodes is ``BASE+FLAG+FLAG`` (``IDLE+DRAIN``, ``DOWN+NOT_RESPONDING``) on
  both; ``sinfo`` instead uses short lower-case names with suffix symbols (``down*``,
  ``drng``, ``idle~``), which parse_node_states() also accepts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "JobInfo",
    "NodeInfo",
    "SlurmParseError",
    "expand_hostlist",
    "parse_exit_code",
    "parse_hostnames",
    "parse_job",
    "parse_jobs",
    "parse_key_values",
    "parse_node",
    "parse_node_states",
    "parse_nodes",
    "parse_sbatch_parsable",
    "parse_slurm_version",
    "parse_tasks_per_node",
]


class SlurmParseError(ValueError):
    """Slurm printed something this parser does not understand (message quotes it)."""


@dataclass(frozen=True)
class JobInfo:
    """One job as ``scontrol show job`` sees it (finished jobs stay visible for MinJobAge)."""

    job_id: str
    state: str
    reason: str
    nodes: tuple[str, ...]
    user: str
    user_id: int
    restart_count: int
    exit_code: int
    exit_signal: int
    excluded_nodes: tuple[str, ...]
    work_dir: str
    name: str
    requeue: bool
    held: bool
    #: Every field as printed, for what the typed attributes do not cover (StdOut, Partition).
    fields: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class NodeInfo:
    """One node; ``states`` is the set form of ``IDLE+DRAIN`` so flags are tested by membership."""

    name: str
    states: frozenset[str]
    reason: str | None
    reason_user: str | None
    address: str
    hostname: str
    reason_time: str | None = None
    fields: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def drained(self) -> bool:
        """Drain was requested (jobs may still be finishing: DRAINING) or is complete."""
        return bool(self.states & {"DRAIN", "DRAINED", "DRAINING"})

    @property
    def failed(self) -> bool:
        """Marked FAIL (``scontrol update State=FAIL``), whether or not jobs still run on it."""
        return bool(self.states & {"FAIL", "FAILING"})

    @property
    def down(self) -> bool:
        return "DOWN" in self.states

    @property
    def responding(self) -> bool:
        return "NOT_RESPONDING" not in self.states

    @property
    def out_of_service(self) -> bool:
        """Drained, draining, failed or down: the states in which a node's reason is in force."""
        return self.drained or self.failed or self.down

    @property
    def effective_reason(self) -> str | None:
        """The reason, only while it holds the node out of service; else None.

        Slurm 24.11 keeps a node's ``Reason`` after ``State=RESUME`` (``State=IDLE ...
        Reason=...``), where 22.05 clears it. A leftover reason on a node in service says
        nothing: reading it as "drained" kept resumed nodes listed by ``review`` and made the
        controller leave a corrupting node in service because an old maintenance reason was
        still attached to it.
        """
        return self.reason if self.out_of_service else None


# A key starts a new field only when preceded by whitespace or the line start.
_KEY_RE = re.compile(r"(?:^|(?<=\s))([A-Z][A-Za-z0-9_:/]*)=")
_NODE_REASON_START = re.compile(r"(?:^|(?<=\s))Reason=")
_REASON_TRAILER = re.compile(r"\s\[(?P<user>[^\s@\[\]]+)@(?P<time>[^\s\]]+)\](?=\s|$)")
_AFTER_REASON_KEYS = re.compile(r"\s(?=(?:Comment|Extra|InstanceId|InstanceType|ReservationName)=)")
_NULL = ("", "(null)", "None", "N/A")


def parse_key_values(line: str) -> dict[str, str]:
    """Split one ``scontrol show -o`` record into a dict; the first occurrence of a key wins."""
    matches = list(_KEY_RE.finditer(line))
    if not matches:
        raise SlurmParseError(f"no Key=value pairs in Slurm output: {line[:200]!r}")
    if line[: matches[0].start()].strip():
        raise SlurmParseError(f"unexpected text before first key: {line[:200]!r}")
    result: dict[str, str] = {}
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        result.setdefault(match.group(1), line[match.end() : end].strip())
    return result


def _records(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _hostlist_or_empty(value: str | None) -> tuple[str, ...]:
    if value is None or value in _NULL:
        return ()
    return tuple(expand_hostlist(value))


def parse_exit_code(value: str) -> tuple[int, int]:
    """``"3:0"`` -> (3, 0): exit status and terminating signal."""
    try:
        code, _, sig = value.partition(":")
        return int(code), int(sig or 0)
    except ValueError as exc:
        raise SlurmParseError(f"bad ExitCode {value!r}; expected 'status:signal'") from exc


_USER_RE = re.compile(r"^(?P<name>.*)\((?P<uid>\d+)\)$")


def _require(fields: Mapping[str, str], key: str, line: str) -> str:
    try:
        return fields[key]
    except KeyError:
        raise SlurmParseError(f"field {key} missing in Slurm record: {line[:200]!r}") from None


def _int(fields: Mapping[str, str], key: str, line: str, default: int | None = None) -> int:
    raw = fields.get(key)
    if raw is None:
        if default is not None:
            return default
        raise SlurmParseError(f"field {key} missing in Slurm record: {line[:200]!r}")
    try:
        return int(raw)
    except ValueError as exc:
        raise SlurmParseError(f"field {key}={raw!r} is not an integer") from exc


def parse_job(line: str) -> JobInfo:
    """Parse one ``scontrol show -o job`` line."""
    fields = parse_key_values(line)
    job_id = _require(fields, "JobId", line)
    user_field = _require(fields, "UserId", line)
    user_match = _USER_RE.match(user_field)
    if user_match is None:
        raise SlurmParseError(f"bad UserId {user_field!r}; expected 'name(uid)'")
    exit_code, exit_signal = parse_exit_code(fields.get("ExitCode", "0:0"))
    state = _require(fields, "JobState", line)
    reason = fields.get("Reason", "None")
    # Slurm holds a job by setting its priority to 0; the reason says who held it.
    held = state == "REQUEUE_HOLD" or (
        state == "PENDING"
        and (fields.get("Priority") == "0" or reason in ("JobHeldUser", "JobHeldAdmin"))
    )
    return JobInfo(
        job_id=job_id,
        state=state,
        reason=reason,
        nodes=_hostlist_or_empty(fields.get("NodeList")),
        user=user_match.group("name"),
        user_id=int(user_match.group("uid")),
        restart_count=_int(fields, "Restarts", line, default=0),
        exit_code=exit_code,
        exit_signal=exit_signal,
        excluded_nodes=_hostlist_or_empty(fields.get("ExcNodeList")),
        work_dir=fields.get("WorkDir", ""),
        name=fields.get("JobName", ""),
        requeue=fields.get("Requeue") == "1",
        held=held,
        fields=fields,
    )


def parse_jobs(text: str) -> list[JobInfo]:
    """Parse ``scontrol show -o job [J]`` output: one record per non-empty line."""
    return [parse_job(line) for line in _records(text)]


def _split_node_reason(line: str) -> tuple[str, str | None, str | None, str | None]:
    """Cut ``Reason=... [user@time]`` out of a node line: (rest, reason, user, time)."""
    start = _NODE_REASON_START.search(line)
    if start is None:
        return line, None, None, None
    after = line[start.end() :]
    trailer = _REASON_TRAILER.search(after)
    if trailer is not None:
        reason = after[: trailer.start()]
        rest = line[: start.start()] + after[trailer.end() :]
        return rest, reason.strip(), trailer.group("user"), trailer.group("time")
    cut = _AFTER_REASON_KEYS.search(after)
    end = cut.start() if cut else len(after)
    return line[: start.start()] + after[end:], after[:end].strip(), None, None


_SUFFIX_FLAGS = {
    "*": "NOT_RESPONDING",
    "~": "POWERED_DOWN",
    "#": "POWERING_UP",
    "%": "POWERING_DOWN",
    "!": "POWER_DOWN",
    "@": "REBOOT_REQUESTED",
    "^": "REBOOT_ISSUED",
    "$": "MAINT",
    "-": "PLANNED",
}
_SHORT_STATES = {
    "ALLOC": "ALLOCATED",
    "MIX": "MIXED",
    "COMP": "COMPLETING",
    "DRNG": "DRAINING",
    "DRAIN": "DRAIN",
    "FAILG": "FAILING",
    "UNK": "UNKNOWN",
    "RESV": "RESERVED",
    "PLND": "PLANNED",
    "NPC": "PERFCTRS",
    "INVAL": "INVALID",
    "FUTR": "FUTURE",
    "BLOCK": "BLOCKED",
}


def parse_node_states(value: str) -> frozenset[str]:
    """``IDLE+DRAIN`` / ``DOWN*`` / ``drng`` -> upper-case state set.

    Suffix symbols (sinfo style) become flags: ``DOWN*`` -> {DOWN, NOT_RESPONDING}.
    """
    states: set[str] = set()
    for part in value.strip().split("+"):
        part = part.strip()
        while part and part[-1] in _SUFFIX_FLAGS:
            states.add(_SUFFIX_FLAGS[part[-1]])
            part = part[:-1]
        if part:
            upper = part.upper()
            states.add(_SHORT_STATES.get(upper, upper))
    if not states:
        raise SlurmParseError(f"empty node state {value!r}")
    return frozenset(states)


def parse_node(line: str) -> NodeInfo:
    """Parse one ``scontrol show -o node`` line."""
    rest, reason, reason_user, reason_time = _split_node_reason(line)
    fields = parse_key_values(rest)
    if reason is not None:
        fields["Reason"] = reason
    name = _require(fields, "NodeName", line)
    return NodeInfo(
        name=name,
        states=parse_node_states(_require(fields, "State", line)),
        reason=reason or None,
        reason_user=reason_user,
        address=fields.get("NodeAddr", name),
        hostname=fields.get("NodeHostName", name),
        reason_time=reason_time,
        fields=fields,
    )


def parse_nodes(text: str) -> list[NodeInfo]:
    """Parse ``scontrol show -o node [N]`` output: one record per non-empty line."""
    return [parse_node(line) for line in _records(text)]


def parse_hostnames(text: str) -> list[str]:
    """Parse ``scontrol show hostnames EXPR``: one name per line."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def parse_sbatch_parsable(text: str) -> str:
    """``sbatch --parsable`` prints ``JOBID`` or ``JOBID;CLUSTER``; return the job id."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise SlurmParseError("sbatch --parsable printed nothing; check sbatch's stderr")
    job_id = lines[-1].split(";", 1)[0]
    if not job_id.isdigit():
        raise SlurmParseError(
            f"sbatch --parsable printed {lines[-1]!r}, expected a job id; "
            "a job_submit plugin or wrapper may be adding output"
        )
    return job_id


_VERSION_RE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def parse_slurm_version(text: str) -> tuple[int, int, int]:
    """``slurm 22.05.8`` / ``slurm-wlm 24.11.5`` -> (22, 5, 8)."""
    match = _VERSION_RE.search(text)
    if match is None:
        raise SlurmParseError(f"no Slurm version in {text.strip()[:100]!r}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def _split_top_level(expr: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmParseError(f"unbalanced ']' in hostlist {expr!r}")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise SlurmParseError(f"unbalanced '[' in hostlist {expr!r}")
    parts.append("".join(current))
    return [p for p in parts if p]


def _expand_ranges(body: str, expr: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise SlurmParseError(f"bad range {item!r} in hostlist {expr!r}")
        if not sep:
            out.append(lo)
            continue
        width = len(lo) if lo.startswith("0") else 0
        start, stop = int(lo), int(hi)
        if stop < start or stop - start > 100_000:
            raise SlurmParseError(f"bad range {item!r} in hostlist {expr!r}")
        out.extend(str(n).zfill(width) for n in range(start, stop + 1))
    return out


def _expand_one(item: str, expr: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.find("]", open_at)
    prefix, body, suffix = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    tails = _expand_one(suffix, expr)
    return [prefix + mid + tail for mid in _expand_ranges(body, expr) for tail in tails]


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist (``node[1-3,5],gpu-[01-02]``) without calling Slurm.

    The EpilogSlurmctld gets ``SLURM_JOB_NODELIST`` in this compressed form and should not
    need a subprocess (or a reachable slurmctld) just to read it.
    """
    expr = expr.strip()
    if not expr or expr in _NULL:
        return []
    names: list[str] = []
    for item in _split_top_level(expr):
        names.extend(_expand_one(item.strip(), expr))
    return names


_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` (``2(x3),1``: 2 tasks on each of 3 nodes, then 1).

    One count per node, in the order of the node list, so ``SLURM_NODEID`` indexes it.
    """
    counts: list[int] = []
    for item in value.strip().split(","):
        match = _TASKS_ITEM.match(item.strip())
        if match is None:
            raise SlurmParseError(f"bad tasks-per-node item {item!r} in {value!r}")
        repeat = int(match.group(2) or 1)
        if repeat > 100_000:
            raise SlurmParseError(f"bad tasks-per-node item {item!r} in {value!r}")
        counts.extend([int(match.group(1))] * repeat)
    return counts
