#!/bin/bash
# EpilogSlurmctld program for slurm-guard: after every job, let the controller act on the
# job's alarms (drain the suspect node, requeue the job without it).
#
# slurmctld runs this as SlurmUser with no PATH and (on 22.05) no SLURM_CONF, and only logs a
# failure; a slow epilog delays the job's completion. So: set both, bound the run time, log
# everything, and always exit 0. Anything not finished here (slurmctld busy, lock held, timeout)
# is recorded as pending in the state dir and finished by `slurm-guard controller --watch` or
# by the next epilog run.
#
# Site settings come from /etc/default/slurm-guard (optional), for example:
#   SLURM_GUARD=/opt/slurm-guard/venv/bin/slurm-guard
#   SLURM_GUARD_STATE_DIR=/var/lib/slurm-guard
#   SLURM_GUARD_RUNS_ROOT=/shared/runs
#   SLURM_GUARD_LOG=/var/log/slurm/slurm-guard-epilog.log
#   SLURM_CONF=/etc/slurm/slurm.conf

export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
SLURM_GUARD_DEFAULTS=${SLURM_GUARD_DEFAULTS:-/etc/default/slurm-guard}
# shellcheck disable=SC1090
[ -r "$SLURM_GUARD_DEFAULTS" ] && . "$SLURM_GUARD_DEFAULTS"

export SLURM_CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
export SLURM_GUARD_STATE_DIR=${SLURM_GUARD_STATE_DIR:-/var/lib/slurm-guard}
[ -n "${SLURM_GUARD_RUNS_ROOT:-}" ] && export SLURM_GUARD_RUNS_ROOT
SLURM_GUARD=${SLURM_GUARD:-slurm-guard}
LOG=${SLURM_GUARD_LOG:-/var/log/slurm/slurm-guard-epilog.log}
TIMEOUT_S=${SLURM_GUARD_EPILOG_TIMEOUT:-60}

mkdir -p "$(dirname "$LOG")" 2>/dev/null
# An unwritable log must not stop the epilog from doing its work.
touch "$LOG" 2>/dev/null || LOG=/dev/null
{
    echo "$(date '+%F %T') job=${SLURM_JOB_ID:-?} restart=${SLURM_JOB_RESTART_COUNT:-0} exit=${SLURM_JOB_EXIT_CODE2:-?} nodes=${SLURM_JOB_NODELIST:-?}"
    timeout --kill-after=5 "$TIMEOUT_S" "$SLURM_GUARD" epilog
    rc=$?
    [ "$rc" -ne 0 ] && echo "$(date '+%F %T') job=${SLURM_JOB_ID:-?} slurm-guard epilog exited $rc (124 = timeout); the watcher retries pending jobs"
} >>"$LOG" 2>&1 </dev/null
exit 0
