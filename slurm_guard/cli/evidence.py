"""Evidence commands: `diagnose` (a node burn-in) and `report` (a run's timeline as HTML).

Thin like the other command modules: options in, one library call, output and exit status out.
`diagnose` imports torch only when it runs a burn-in (not for `--import` or `--help`), and
`report` imports matplotlib only when it draws, so neither slows down the other commands.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import click

from slurm_guard.protocol import DEFAULT_STATE_DIR
from slurm_guard.rundir.records import RecordError

if TYPE_CHECKING:
    from slurm_guard.diagnose.evidence import Diagnosis

EXIT_DIAGNOSIS_FAILED = 3
"""`diagnose` found the node faulty. 1 stays "could not diagnose" (an error with a message)."""


def _print_diagnosis(d: Diagnosis, recorded: Path | None) -> None:
    facts = d.device
    what = f"{facts.get('kind')} x{facts.get('count', 1)} {facts.get('model')}"
    if facts.get("kind") == "cuda":
        what += f", driver {facts.get('driver')}, CUDA {facts.get('cuda')}"
    else:
        what += f", {facts.get('threads')} threads"
    what += f", torch {facts.get('torch')}"
    click.echo(f"{d.node}: {'PASSED' if d.passed else 'FAILED'}  ({what})")
    seconds = d.finished - d.started
    click.echo(f"  {len(d.cases)} cases in {seconds:.1f} s; golden result: {d.golden}")
    header = ["CASE", "DEVICE", "REPEATS", "DIFFER", "CHECKSUM", "GOLDEN"]
    rows = [
        [
            c.case,
            str(c.device_index),
            str(c.repeats),
            str(c.mismatches),
            ("ok" if c.checksum_ok else "FAIL") + f" ({c.checksum_excess:.2g})",
            c.golden,
        ]
        for c in d.cases
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        click.echo(("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))).rstrip())
    for line in d.failures():
        click.echo(f"  problem: {line}")
    for fault in d.faults:
        click.echo(f"  injected fault: {fault}")
    if recorded is not None:
        click.echo(f"  recorded as evidence for {d.node}: {recorded}")


def _day(ts: Any) -> str:
    import time

    try:
        return time.strftime("%Y-%m-%d %H:%M", time.gmtime(float(ts)))
    except (TypeError, ValueError, OverflowError):
        return "?"


def _printable(text: Any) -> str:
    """Node and alarm fields come from files users wrote: no control characters on a terminal."""
    return "".join(c if c.isprintable() else "?" for c in str(text))


def print_node_evidence(n: dict[str, Any]) -> None:
    """`review`'s lines for one node: alarms over time, the latest diagnosis, return blockers."""
    node = _printable(n.get("node"))
    history = n.get("history") or []
    confirmed = sum(1 for a in history if a.get("confirmed"))
    if history:
        click.echo(
            f"  {node}: {len(history)} alarm(s) since {_day(history[0].get('time'))} UTC, "
            f"{confirmed} confirmed ({n.get('confirmed_recent', 0)} in the retire window)"
        )
    for a in history:
        triage = a.get("triage")
        extra = f" triage: {json.dumps(triage, sort_keys=True)[:120]}" if triage else ""
        approved = " (approved)" if a.get("approved") else ""
        click.echo(
            "    "
            + _printable(
                f"{_day(a.get('time'))} job {a.get('job_id')} step {a.get('step')} "
                f"{a.get('check')}/{a.get('verdict')} -> {a.get('outcome')}{approved}{extra}"
            )
        )
    d = n.get("diagnosis")
    if d is None:
        click.echo(f"  {node}: never diagnosed (run `slurm-guard diagnose` on it)")
    else:
        verdict = "passed" if d.get("passed") else "FAILED"
        first = f": {d['failures'][0]}" if d.get("failures") else ""
        click.echo(
            _printable(
                f"  {node}: latest diagnosis {_day(d.get('finished'))} UTC {verdict} "
                f"({d.get('device')}, golden {d.get('golden')}){first}"
            )[:400]
        )
    for why in n.get("return_blockers") or []:
        click.echo(_printable(f"  {node}: `review return` refuses it: {why}")[:400])


def _writable_state_dir(state_dir: Path) -> Path:
    import os

    if not state_dir.is_dir() or not os.access(state_dir, os.W_OK):
        raise click.ClickException(
            f"state directory {state_dir} does not exist or is not writable here. Either pass "
            "--state-dir pointing at the controller's state directory (shared storage), or run "
            "`slurm-guard diagnose --no-record --json > NODE.json` on the node and "
            "`slurm-guard diagnose --import NODE.json` on the controller host"
        )
    return state_dir


@click.command("diagnose")
@click.option(
    "--duration",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Seconds of repeated GEMMs after the first pass over the cases.",
)
@click.option(
    "--size", type=click.IntRange(min=2), default=1024, show_default=True, help="Matrix size N."
)
@click.option(
    "--seeds", type=click.IntRange(min=1), default=2, show_default=True, help="Cases per precision."
)
@click.option(
    "--precision",
    "precisions",
    multiple=True,
    type=click.Choice(["fp32", "tf32", "bf16", "fp16"]),
    help="Precisions to run (repeatable); default every one the device supports.",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cuda", "cpu"]),
    default="auto",
    show_default=True,
    help="auto: every GPU if CUDA is available, else the CPU.",
)
@click.option(
    "--node",
    default=None,
    help="Slurm node name to record the evidence for (default $SLURMD_NODENAME or the host name).",
)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_STATE_DIR,
    envvar="SLURM_GUARD_STATE_DIR",
    show_default=True,
    help="Controller state: golden results are read there, the diagnosis is recorded there.",
)
@click.option(
    "--no-record",
    is_flag=True,
    help="Only run and print (use with --json on a node that cannot see the state directory).",
)
@click.option(
    "--import",
    "import_file",
    type=click.File("r"),
    default=None,
    help="Compare a --no-record --json result from a node with the golden results and record it.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def diagnose_cmd(
    duration: float,
    size: int,
    seeds: int,
    precisions: tuple[str, ...],
    device: str,
    node: str | None,
    threads: int | None,
    state_dir: Path,
    no_record: bool,
    import_file: IO[str] | None,  # click.File; its LazyFile proxies a text file
    as_json: bool,
) -> None:
    """Burn in this node's devices with known-answer GEMMs; record the result as evidence.

    Seeded GEMMs in fp32 (and tf32, bf16, fp16 where the device has them) are repeated for
    --duration seconds. Every repeat must be bit-identical to the first result, column
    checksums must hold, and each result must equal the golden one: recorded in the state
    directory by the first node with the same device model, driver and torch that passed.
    Exit status 0: passed; 3: the node failed (see the problems); 1: could not diagnose.

    Run it on the node (ssh/pdsh/clush), or in a maintenance reservation with srun.

    Example:

        \b
        ssh node2 slurm-guard diagnose --state-dir /shared/slurm-guard-state
        srun --reservation=maint -w node2 -N1 slurm-guard diagnose --duration 300
        ssh node2 slurm-guard diagnose --no-record --json > node2.json
        slurm-guard diagnose --import node2.json
    """
    from slurm_guard.diagnose.evidence import (
        judge_against_golden,
        parse_diagnosis,
        record_diagnosis,
    )

    if import_file is not None and no_record:
        raise click.ClickException("--import records a result; it cannot be used with --no-record")
    try:
        if import_file is not None:
            try:
                obj = json.load(import_file)
            except (ValueError, RecursionError) as exc:
                raise click.ClickException(f"{import_file.name}: not JSON ({exc})") from None
            diagnosis = parse_diagnosis(obj, import_file.name)
            if node is not None and node != diagnosis.node:
                raise click.ClickException(
                    f"{import_file.name} is a diagnosis of {diagnosis.node}, not {node}"
                )
        else:
            if not no_record:
                _writable_state_dir(state_dir)
            diagnosis = _run(duration, size, seeds, precisions, device, node, threads)
        recorded = None
        if not no_record:
            _writable_state_dir(state_dir)
            diagnosis = judge_against_golden(state_dir, diagnosis)
            recorded = record_diagnosis(state_dir, diagnosis)
    except RecordError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot record the diagnosis: {exc}") from None
    if as_json:
        out = diagnosis.to_json()
        out["recorded"] = str(recorded) if recorded else None
        click.echo(json.dumps(out, indent=2, sort_keys=True))
    else:
        _print_diagnosis(diagnosis, recorded)
    sys.stdout.flush()
    if not diagnosis.passed:
        sys.exit(EXIT_DIAGNOSIS_FAILED)


def _run(
    duration: float,
    size: int,
    seeds: int,
    precisions: tuple[str, ...],
    device: str,
    node: str | None,
    threads: int | None,
) -> Diagnosis:
    from slurm_guard.diagnose.burn_in import (
        DiagnoseConfig,
        default_node_name,
        faults_for_diagnose,
        run_diagnosis,
    )
    from slurm_guard.errors import GuardError

    try:
        config = DiagnoseConfig(
            node=node or default_node_name(),
            duration_s=duration,
            size=size,
            seeds=seeds,
            precisions=precisions or None,
            device=device,
            threads=threads,
            faults=faults_for_diagnose(),
        )
        return run_diagnosis(config)
    except GuardError as exc:
        raise click.ClickException(str(exc)) from None


@click.command("report")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("report.html"),
    show_default=True,
    help="The HTML file to write.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a summary as JSON.")
def report_cmd(run_dir: Path, output: Path, as_json: bool) -> None:
    """Write a run's timeline as one self-contained HTML page.

    A plot over steps of the loss (a script records it with
    slurm_guard.report.record_loss(run_dir, step, loss) on rank 0), the verification results
    by check, the checkpoints, the alarm, the rollback and each restart (numbered as `status`
    numbers them), then the records as tables. Reads only the run directory. The plot needs
    matplotlib (pip install 'slurm-guard[report]'); without it the page has the tables only.

    Example:

        \b
        slurm-guard report /shared/runs/llama-7b -o llama-7b.html
    """
    from slurm_guard.report import ReportError, matplotlib_available, write_report

    try:
        timeline = write_report(run_dir, output)
    except ReportError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc}") from None
    summary: dict[str, Any] = {
        "output": str(output),
        "plot": matplotlib_available(),
        "alarms": [a.alarm_id for a in timeline.alarms],
        "restarts": len(timeline.restarts) - 1 if timeline.restarts else 0,
        "checks": len(timeline.checks),
        "loss_points": len(timeline.losses),
        "problems": timeline.problems,
    }
    if as_json:
        click.echo(json.dumps(summary, indent=2, sort_keys=True))
        return
    click.echo(
        f"wrote {output}: {summary['checks']} verification results, "
        f"{len(summary['alarms'])} alarm(s), {summary['restarts']} restart(s)"
    )
    if not summary["plot"]:
        click.echo("no plot: matplotlib is not installed (pip install 'slurm-guard[report]')")
    for problem in timeline.problems:
        click.echo(f"unreadable record (shown on the page): {problem}")


def register_evidence_commands(group: click.Group) -> None:
    """Attach `diagnose` and `report` to the top-level group."""
    group.add_command(diagnose_cmd)
    group.add_command(report_cmd)
