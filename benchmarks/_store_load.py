"""`scaling.py --store-load`: rank 0's TCPStore load per guard round, N simulated ranks.

Each simulated rank is a real TCPStore client (its own connections, as every rank of a job has)
driving the guard's real code: `HangWatch` (its listener's one blocking wait included) for the
store side of a plain step and of a replay step (both only `arm`/`disarm`: the replay's exchange
and the verdict are backend collectives, no store request), and `HangWatch.store_round`, the
round `Guard()` and `save_checkpoint()` make. The store's server runs in a child process, whose
CPU time is read from /proc before and after each round; wall time is the round's, from the
first rank's start to the last rank's return. The backend collectives are not part of this
(they are `scaling.py`'s other rows).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from slurm_guard.comm.collective import _tag
from slurm_guard.comm.watchdog import HangWatch

_SERVER = (
    "import sys, time, datetime, torch.distributed as d\n"
    "s = d.TCPStore('127.0.0.1', 0, None, True, datetime.timedelta(seconds=600),"
    " wait_for_workers=False)\n"
    "print(s.port, flush=True)\n"
    "sys.stdin.read()\n"
)


def _cpu_seconds(pid: int) -> float:
    """CPU time of every thread of `pid`, in ns resolution (schedstat, not the 10 ms ticks)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def _round(watches: list[HangWatch], work: Any, pid: int) -> tuple[float, float]:
    """Server CPU and wall seconds of one round in which every simulated rank runs `work`."""
    go = threading.Barrier(len(watches) + 1)
    ends: list[float] = []

    def rank(w: HangWatch) -> None:
        go.wait()
        work(w)
        ends.append(time.perf_counter())

    threads = [threading.Thread(target=rank, args=(w,)) for w in watches]
    for t in threads:
        t.start()
    cpu = _cpu_seconds(pid)
    go.wait()  # every simulated rank starts now, its thread already running
    start = time.perf_counter()
    for t in threads:
        t.join()
    return _cpu_seconds(pid) - cpu, max(ends) - start


def measure(world: int, rounds: int = 3) -> dict[str, dict[str, float]]:
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    port = int(server.stdout.readline())
    try:
        base = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, None, False, datetime.timedelta(seconds=600)
        )
        watches = [
            HangWatch(base.clone(), "bench/", r, world, f"node{r // 8}", 300.0)
            for r in range(world)
        ]
        time.sleep(1.0)  # every listener has issued its one blocking wait
        seq = [0]

        def plain(w: HangWatch) -> None:
            w.arm(f"step {seq[0]}")
            w.disarm()

        def store_round(what: str) -> Any:
            def run(w: HangWatch) -> None:
                w.store_round(seq[0], what, _tag(what))

            return run

        out: dict[str, dict[str, float]] = {}
        for name in ("plain step", "replay step", "Guard()", "save_checkpoint()"):
            cpus, walls = [], []
            for _ in range(rounds):
                seq[0] += 1
                if name in ("plain step", "replay step"):
                    work = plain
                else:
                    work = store_round(f"{name} {seq[0]}")
                cpu, wall = _round(watches, work, server.pid)
                cpus.append(cpu)
                walls.append(wall)
            out[name] = {"server_cpu_s": min(cpus), "wall_s": min(walls)}
        return out
    finally:
        server.kill()
        server.wait()


def main(worlds: list[int], rounds: int) -> dict[int, dict[str, dict[str, float]]]:
    """Each N in a process of its own (thousands of clients and threads are not torn down)."""
    results: dict[int, dict[str, dict[str, float]]] = {}
    print("| N | round | server CPU per round | wall per round |")
    print("|---|---|---|---|")
    for world in worlds:
        code = (
            "import json, os, sys, _store_load\n"
            f"print('RESULT ' + json.dumps(_store_load.measure({world}, {rounds})), flush=True)\n"
            "os._exit(0)\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
        )
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
        results[world] = json.loads(line[len("RESULT ") :])
        for name, v in results[world].items():
            print(
                f"| {world} | {name} | {v['server_cpu_s'] * 1e3:.1f} ms | "
                f"{v['wall_s'] * 1e3:.1f} ms |",
                flush=True,
            )
    return results
