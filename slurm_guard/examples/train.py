"""Guarded training of the tiny GPT: the entry point of the sbatch template, the drill and the demo.

    srun python -m slurm_guard.examples.train --run-dir /shared/runs/demo --steps 100

It is the smallest complete guarded loop: join the process group (from Slurm's environment
under srun, from torchrun's otherwise), wrap the model in DDP and a Guard (with `--sharded`:
a tiny Llama under HSDP and a ShardedGuard, `examples.train_sharded`), resume from the
trusted checkpoint, train with deterministic data per (step, rank), checkpoint, and exit with
the guard's code (86) on an alarm. A requeued job runs the same command and continues where the
trusted checkpoint says.

For drills it writes two small files into the run directory (rank 0 only):

* `train-events.jsonl`: one line per start, alarm and finish (time, restart count, step, nodes),
  so a drill can time the gap between a stop and the requeued start;
* `result.json`: the final step and a sha256 of everything the replicas hold (parameters,
  buffers, optimizer state), so two runs can be compared bit for bit.

A fault can be injected with `--inject` (SLURM_GUARD_INJECT syntax). `node=@rankN` means "the
node rank N runs on in the first start of this run": the drill cannot know in advance where
Slurm places the job, and a broken GPU stays on its node when the job is requeued elsewhere.
The resolved node is kept in `injected-fault.json` so every restart injects on the same node.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from slurm_guard.config import GuardConfig
from slurm_guard.errors import GuardError, SilentDataCorruption
from slurm_guard.examples.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss, make_batch
from slurm_guard.faults.injection import parse_faults
from slurm_guard.guard import Guard, exit_on_alarm
from slurm_guard.rundir.records import RecordError, atomic_write_json, read_json_file

if TYPE_CHECKING:
    # The DDP path must not import FSDP: a torch without it still runs the plain demo.
    from slurm_guard.sharded.guard import ShardedGuard

logger = logging.getLogger(__name__)

RESULT_FILE = "result.json"
EVENTS_FILE = "train-events.jsonl"
FAULT_FILE = "injected-fault.json"
RESULT_SCHEMA = 1

MODELS = {
    # Small enough for three ranks on two CPU cores in seconds (the drill, the tests).
    "small": TinyGPTConfig(vocab=32, context=8, width=16, heads=2, layers=1, dropout=0.1),
    "tiny": TinyGPTConfig(),
}
_RANK_NODE = re.compile(r"node=@rank(\d+)")


@dataclass(frozen=True)
class TrainSettings:
    """Everything a run needs; picklable, so submitit and local processes can carry it.

    Defaults are the drill's: a persistent fault starting between two verifications is caught
    at the next replay step and the run resumes from a checkpoint before it.
    """

    run_dir: str
    steps: int = 30
    checkpoint_every: int = 10
    replay_every: int = 5
    vote_every: int = 5
    model: str = "small"
    seed: int = 0
    lr: float = 1e-2
    batch_size: int = 4
    inject: str = ""
    threads: int = 1
    sharded: bool = False  # the tiny Llama under HSDP and ShardedGuard (examples.train_sharded)
    tp: int = 1  # with sharded: FSDP2 + tensor parallel of this degree instead of HSDP
    trust_replays: int = 2
    snapshots: bool = False  # GuardConfig(snapshots=True): node-local verified snapshots

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise GuardError(f"unknown model {self.model!r}; choose one of {sorted(MODELS)}")
        if self.steps < 1 or self.checkpoint_every < 1:
            raise GuardError("steps and checkpoint_every must be >= 1")


def state_sha256(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 over the exact bytes of every tensor, in order: equal iff bit-identical."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(str((t.dtype, tuple(t.shape))).encode())
        # A compact copy, so the storage holds exactly this tensor's bytes (no numpy needed).
        flat = t.detach().to("cpu").reshape(-1).clone()
        digest.update(bytes(flat.view(torch.uint8).untyped_storage()))
    return digest.hexdigest()


def _weights_sha256(guard: Guard | ShardedGuard, device: torch.device, *, sharded: bool) -> str:
    """What the replicas hold, hashed; under HSDP every rank's shards, gathered (collective)."""
    local = state_sha256(guard.state_tensors())
    if not sharded:
        return local
    from slurm_guard.examples.train_sharded import gathered_sha256

    return gathered_sha256(local, device)


def _append_event(run_dir: Path, event: dict[str, Any]) -> None:
    line = json.dumps({"time": time.time(), **event}, sort_keys=True) + "\n"
    fd = os.open(run_dir / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a run, skipping a torn last line."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return []
    out = []
    for raw in path.read_bytes().splitlines():
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def read_result(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """`result.json` of a finished run, or None if the run has not finished."""
    try:
        obj = read_json_file(Path(run_dir) / RESULT_FILE)
    except RecordError:
        return None
    return obj if isinstance(obj, dict) else None


def _all_nodes(device: torch.device) -> list[str]:
    """Every rank's node, through tensors: torch's object collectives need numpy to unpickle,
    and numpy is not a dependency (a fresh venv with only torch has none)."""
    from slurm_guard.comm.topology import gather_rank_infos, local_rank_info

    infos = gather_rank_infos(local_rank_info(dist.get_rank()), None, device)
    return [info.node for info in infos]


def _broadcast_text(text: str, device: torch.device) -> str:
    """Rank 0's `text` on every rank (length first, then the UTF-8 bytes; no pickling)."""
    data = text.encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if dist.get_rank() == 0:
        buf = torch.tensor(list(data), dtype=torch.uint8, device=device)
    else:
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0)
    return bytes(buf.cpu().tolist()).decode()


def resolve_inject(spec: str, run_dir: Path, device: torch.device | None = None) -> str:
    """Replace `node=@rankN` by a node name, the same for every start of the run (collective).

    `device` is where the collectives' tensors live: the CUDA device under NCCL, the CPU
    under gloo (the default).
    """
    if not _RANK_NODE.search(spec):
        return spec
    device = device if device is not None else torch.device("cpu")
    nodes = _all_nodes(device)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        path = run_dir / FAULT_FILE
        try:
            box[0] = str(read_json_file(path)["spec"])
        except (RecordError, KeyError, TypeError):

            def node_of(match: re.Match[str]) -> str:
                rank = int(match.group(1))
                if rank >= len(nodes):
                    raise GuardError(f"--inject names rank {rank}, but there are {len(nodes)}")
                return f"node={nodes[rank]}"

            try:
                resolved = _RANK_NODE.sub(node_of, spec)
                atomic_write_json(path, {"spec": resolved, "requested": spec, "nodes": nodes})
                box[0] = resolved
            except (GuardError, OSError) as exc:
                # Every rank must learn of it, or the others wait in the broadcast below.
                box[0] = f"error: {exc}"
    resolved = _broadcast_text(str(box[0]) if dist.get_rank() == 0 else "", device)
    if resolved.startswith("error: "):
        raise GuardError(resolved[len("error: ") :])
    return resolved


def run_training(settings: TrainSettings) -> dict[str, Any]:
    """Guarded training on an initialized process group; the result dict (same on every rank).

    Raises:
        SilentDataCorruption: on every rank when the guard stops the run.
    """
    if not dist.is_initialized():
        raise GuardError("run_training needs an initialized process group")
    run_dir = Path(settings.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        # One thread per rank: CPU kernels then add in a fixed order, so two runs of the same
        # job agree bit for bit whatever else runs on the machine.
        torch.set_num_threads(settings.threads)
    faults = (
        parse_faults(resolve_inject(settings.inject, run_dir, device)) if settings.inject else ()
    )
    config = GuardConfig(
        replay_every=settings.replay_every,
        vote_every=settings.vote_every,
        faults=faults,
        trust_replays=settings.trust_replays,
        snapshots=settings.snapshots,
    )
    guard: Guard | ShardedGuard
    batch_of: Callable[[int, int], Any]
    if settings.sharded:
        from slurm_guard.examples.train_sharded import build_sharded_job

        job = build_sharded_job(
            run_dir,
            config,
            seed=settings.seed,
            lr=settings.lr,
            batch_size=settings.batch_size,
            device=device,
            tp=settings.tp,
        )
        guard, batch_of = job.guard, job.batch
    else:
        cfg = MODELS[settings.model]
        torch.manual_seed(settings.seed)
        model = TinyGPT(cfg).to(device)
        ddp = DistributedDataParallel(model, device_ids=[device] if cuda else None)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=settings.lr)
        guard = Guard(ddp, optimizer, lm_loss, run_dir, config)

        def gpt_batch(step: int, rank: int) -> dict[str, torch.Tensor]:
            batch = make_batch(step, rank, cfg, settings.batch_size)
            return {k: v.to(device) for k, v in batch.items()}

        batch_of = gpt_batch

    start = guard.resume()
    rank = dist.get_rank()
    nodes = [r.node for r in guard.topology.ranks]
    snapshots = getattr(guard, "snapshots", None)
    if snapshots is not None and snapshots.restored_from_peers:  # tests show where it came from
        event = {"event": "state_from_peers", "rank": rank, "node": nodes[rank]}
        _append_event(run_dir, {**event, "from": snapshots.restored_from_peers, "step": start})
    if rank == 0:
        _append_event(
            run_dir,
            {
                "event": "start",
                "step": start,
                "restart_count": guard.restart_count,
                "job_id": guard.job_id,
                "nodes": nodes,
                "faults": [f.describe() for f in faults],
                "from_snapshot": snapshots is not None and snapshots.resumed_from is not None,
            },
        )
    loss = float("nan")
    try:
        for step in range(start, settings.steps):
            loss = guard.step(batch_of(step, rank))
            if step == start and rank == 0:
                # how long a restart took, to the first step it completed (tests print it)
                _append_event(run_dir, {"event": "first_step", "step": step + 1})
            if (step + 1) % settings.checkpoint_every == 0 or step + 1 == settings.steps:
                guard.save_checkpoint()
    except SilentDataCorruption as exc:
        if rank == 0:
            alarm = exc.alarm
            _append_event(
                run_dir,
                {
                    "event": "alarm",
                    "step": alarm.step,
                    "alarm_id": alarm.alarm_id,
                    "suspect_nodes": list(alarm.suspect_nodes),
                    "restart_count": guard.restart_count,
                },
            )
        raise
    result = {
        "schema": RESULT_SCHEMA,
        "final_step": guard.step_count,
        "weight_sha256": _weights_sha256(guard, device, sharded=settings.sharded),
        "resumed_from": start,
        "restart_count": guard.restart_count,
        "job_id": guard.job_id,
        "nodes": nodes,
        "last_loss": loss,
        "finished": time.time(),
    }
    if rank == 0:
        atomic_write_json(run_dir / RESULT_FILE, result)
        _append_event(run_dir, {"event": "finish", "step": guard.step_count})
    dist.barrier()
    return result


def slurm_task(settings: TrainSettings) -> dict[str, Any]:
    """What each Slurm task runs (submitit: `launch(slurm_task, settings, ...)`).

    Exits the process with the guard's code on an alarm, like the command line.
    """
    from slurm_guard.slurm.task import init_distributed_from_slurm

    init_distributed_from_slurm()
    try:
        with exit_on_alarm():
            return run_training(settings)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _init_process_group() -> None:
    """Under srun: from Slurm. Under torchrun (RANK set): from its environment variables."""
    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        from slurm_guard.slurm.task import init_distributed_from_slurm

        init_distributed_from_slurm()
    elif "RANK" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    else:
        raise GuardError(
            "not started as a distributed job: run under `srun` (one task per GPU) or "
            "`torchrun --nproc-per-node N -m slurm_guard.examples.train ...`"
        )


def parse_args(argv: Sequence[str] | None = None) -> TrainSettings:
    parser = argparse.ArgumentParser(
        prog="python -m slurm_guard.examples.train",
        description="Guarded tiny-GPT training (exits 86 when slurm-guard stops it).",
        epilog="Example: srun python -m slurm_guard.examples.train --run-dir /shared/runs/x",
    )
    parser.add_argument(
        "--run-dir",
        default=os.environ.get("SLURM_GUARD_RUN_DIR"),
        help="run directory on shared storage (default: $SLURM_GUARD_RUN_DIR)",
    )
    defaults = TrainSettings(run_dir="")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every)
    parser.add_argument("--replay-every", type=int, default=defaults.replay_every)
    parser.add_argument("--vote-every", type=int, default=defaults.vote_every)
    parser.add_argument("--model", choices=sorted(MODELS), default=defaults.model)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--trust-replays", type=int, default=defaults.trust_replays)
    parser.add_argument("--snapshots", action="store_true", help="GuardConfig(snapshots=True)")
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="train the tiny Llama under HSDP (2 replica groups) with ShardedGuard",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=defaults.tp,
        help="with --sharded: FSDP2 + tensor parallel of this degree (consecutive ranks)",
    )
    parser.add_argument(
        "--inject",
        default="",
        help="fault to inject (SLURM_GUARD_INJECT syntax; node=@rank1: rank 1's first node)",
    )
    args = parser.parse_args(argv)
    if not args.run_dir:
        parser.error("--run-dir is required (or set SLURM_GUARD_RUN_DIR)")
    fields = {f.name for f in dataclasses.fields(TrainSettings)}
    return TrainSettings(**{k: v for k, v in vars(args).items() if k in fields})


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = parse_args(argv)
    try:
        _init_process_group()
        with exit_on_alarm():
            result = run_training(settings)
    except GuardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
