"""Does a clean guarded run exit 0 every time? Repeats a tiny epoch-loop client under
`slurm-guard local -n 3` and counts the launcher's exit codes.

Issue 43 saw about 1 clean run in 30 end with exit 134 (`terminate called without an active
exception`) after writing its result. One run takes 10-20 s on two idle cores, so this is a
benchmark, not a test: `python benchmarks/clean_exit.py --runs 40`. Every run's stderr is
searched for the abort; PYTHONFAULTHANDLER=1 makes an aborting rank print each thread's Python
stack, which names the thread that was still inside a C++ call.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import table, write_json

HERE = Path(__file__).resolve().parent
CLIENT = HERE / "_clean_exit_client.py"


def one_run(epochs: int, workers: int) -> tuple[int, bool, str, float]:
    """(launcher exit code, result written, stderr tail, seconds) of one 3-rank run."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    env.pop("SLURM_GUARD_INJECT", None)
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "slurm_guard.cli", "local", "-n", "3", "--"]
        cmd += [sys.executable, str(CLIENT), run_dir, str(epochs), str(workers)]
        began = time.monotonic()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        seconds = time.monotonic() - began
        written = (Path(run_dir) / "result.txt").is_file()
    return out.returncode, written, out.stderr[-4000:], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader num_workers")
    parser.add_argument("--quick", action="store_true", help="5 runs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runs = 5 if args.quick else args.runs
    codes: collections.Counter[int] = collections.Counter()
    failures = []
    seconds = []
    for i in range(runs):
        code, written, err, took = one_run(args.epochs, args.workers)
        codes[code] += 1
        seconds.append(took)
        print(
            f"run {i + 1}/{runs}: exit {code}, result {'written' if written else 'missing'}, "
            f"{took:.1f} s",
            flush=True,
        )
        if code != 0 or "terminate called" in err:
            failures.append({"run": i + 1, "exit": code, "written": written, "stderr": err})
            print(err, file=sys.stderr, flush=True)
    print(table(["exit code", "runs"], sorted(codes.items())))
    write_json(
        "clean_exit",
        {
            "runs": runs,
            "exit_codes": {str(k): v for k, v in codes.items()},
            "failures": failures,
            "seconds": seconds,
            "workers": args.workers,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
