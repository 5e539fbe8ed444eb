"""A rank that exits while a hang declaration is under way, for `slurm-guard local -n 3`
(test_watchdog_exit.py).

Rank 0 declares a probe (as a store round slower than PROBE_SECONDS does) while rank 2 has
already begun to exit: rank 2's listener does not answer, so the verdict comes only after
COLLECT_SECONDS. Rank 1's listener has posted its position and waits for that verdict when
rank 1 exits. The watch must not let that listener return into a finalizing interpreter
(abort, exit 134: "terminate called without an active exception"): every rank must exit 0.
"""

from __future__ import annotations

import sys
import threading
import time

import torch.distributed as dist
from torch.distributed import PrefixStore  # type: ignore[attr-defined]

from slurm_guard.comm.collective import _tcp_store
from slurm_guard.comm.watchdog import COLLECT_SECONDS, HangWatch


class _SlowToFinalize:
    """Collected at module teardown, while the interpreter finalizes: holds it there."""

    def __del__(self) -> None:
        time.sleep(COLLECT_SECONDS)


_SLOW: _SlowToFinalize | None = None


def main() -> None:
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = _tcp_store(dist.distributed_c10d._get_default_store())
    assert base is not None
    watch = HangWatch(base, "exit-race/", rank, world, f"node{rank + 1}", 300.0)
    look = PrefixStore("exit-race/", base.clone())  # a connection of its own
    dist.barrier()
    if rank == 2:
        watch.close()  # rank 2 is on its way out: it will not post a position
    dist.barrier()
    if rank == 0:
        # the declarer waits COLLECT_SECONDS for rank 2's position
        declarer = threading.Thread(target=watch.declare, args=("probe",), daemon=True)
        declarer.start()
        look.wait(["pos/0/1"])
        declarer.join()  # the test's own thread: not the watch's to wait for
    elif rank == 1:
        look.wait(["pos/0/1"])  # its listener posted: it now waits for the verdict
        global _SLOW
        _SLOW = _SlowToFinalize()  # the verdict comes while this interpreter finalizes
    dist.destroy_process_group()
    print(f"rank {rank}: work done, exiting", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
