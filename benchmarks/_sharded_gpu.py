"""gpu_check's sharded part: ShardedGuard (FSDP2 `fully_shard`) trained by 4 ranks on ONE GPU.

ShardedGuard needs 2 or more shards, and the lent machine has one GPU. How 4 ranks share it:

- NCCL cannot. A communicator with two ranks on one device fails at init with "Duplicate GPU
  detected : rank 1 and rank 0 both on CUDA device ..." (ncclInvalidUsage). The NCCL user
  guide, "Creating a Communicator": "Using the same CUDA device multiple times as different
  ranks of the same NCCL communicator is not supported and may lead to hangs"; NVIDIA/nccl#103
  (sjeaugey): "It is no longer possible to have multiple ranks use the same GPU since NCCL 2.5".
  No NCCL_* variable switches the check off: init.cc compares (hostHash, busId) of every pair of
  ranks unconditionally. The hostHash can be forged per process with NCCL_HOSTID, which makes
  NCCL treat the ranks as separate nodes talking over sockets; that is outside what NCCL
  supports, so it is only probed (`nccl_probe`, its own time budget), never relied on.
- gloo can. `init_process_group("gloo")` registers gloo for both CPU and CUDA tensors
  (`Backend.backend_capability["gloo"] == ["cpu", "cuda"]` in torch 2.13), and
  ProcessGroupGloo.cpp has CUDA paths for exactly what FSDP2 runs: `_allgather_base`
  (all_gather_into_tensor) is `allgather`, whose CUDA work copies to pinned host memory, runs
  the CPU algorithm and copies back on a side stream; `_reduce_scatter_base`
  (reduce_scatter_tensor) is a clone plus an `allreduce` of the whole input and a copy of this
  rank's chunk; `allreduce` (HSDP's replica all-reduce, clip_grad_norm_) has a CUDA work
  registered in ProcessGroupGlooCuda.cpp. AVG is SUM then a division (AsyncAllreduceWork), so
  FSDP2's default ReduceOp.AVG works (checked here on CPU gloo, torch 2.13). The one gloo
  collective without a CUDA path, allgather_coalesced (all_gather_into_tensor_coalesced), is
  not called by FSDP2's default all-gather. DeviceMesh on a gloo default group with CUDA
  available makes its own group, again gloo (`_get_backend_from_str`). Object collectives
  (DCP's plan exchange) take CPU tensors on a gloo group. The guard's own collectives follow
  the group's backend (`comm.devices.backend_device("gloo")` is CPU), so its verdict rows
  leave the GPU once per step, as they would not under NCCL: this part tests the guard's CUDA
  kernels, FSDP2 on CUDA and DCP on CUDA, not its NCCL transport (the steps part does that).
  pytorch/pytorch#132471 (torch 2.4: fully_shard on a gloo group segfaulted on CUDA) is why
  the part runs in a child with its own budget and reports an error instead of crashing.

So: 4 processes, all on cuda:0, a 2 x 2 HSDP mesh (2 replica groups of 2 shards: the shard
vote and cross-group replays need replicas, the reduce-scatter needs 2 shards), the tiny
Llama-like model of slurm_guard.examples, `abft=True` (every Linear's GEMMs checked). Launch 1
trains the checked guard 6 steps (replay and vote every 2), saves a sealed DCP checkpoint after
step 3, then times plain FSDP2 against ShardedGuard in interleaved windows. Launch 2 builds
the model from another seed, resumes from the checkpoint and must reproduce the sealed shard
fingerprints and launch 1's losses and final state bit for bit. On CUDA, cuBLAS and torch are
put in deterministic mode and attention uses the math kernel: replays compare gradients
exactly, across processes.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WORLD = 4
MESH = (2, 2)  # (replica groups, shards per group)
NODES = [f"gpu-rank{r}" for r in range(WORLD)]
STEPS = 6
SAVE_AT = 3  # the checkpoint holds the state after steps 0..2
K = 5  # steps per timing window
HUGE = 1_000_000


def _sizes(device_type: str) -> tuple[dict[str, int], int]:
    """Model size and tokens per sequence: the CPU run is the tests' model, the GPU a larger one."""
    if device_type == "cuda":
        return {"vocab": 1024, "dim": 256, "heads": 8, "hidden": 704, "layers": 4}, 128
    return {"vocab": 128, "dim": 64, "heads": 4, "hidden": 128, "layers": 2}, 16


def _batch(step: int, rank: int, seq: int, vocab: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (8, seq + 1), generator=gen).to(device)


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """next_token_loss with the math attention kernel (deterministic on CUDA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from slurm_guard.examples.tiny_llama import next_token_loss

    with sdpa_kernel(SDPBackend.MATH):
        return next_token_loss(model, batch)


def _setup(device_type: str) -> tuple[Any, torch.device]:
    from torch.distributed.device_mesh import init_device_mesh

    if device_type == "cuda":
        torch.cuda.set_device(0)  # every rank: the one GPU
        # DeviceMesh sets the device itself, to LOCAL_RANK, unless CUDA is initialised already
        # (torch 2.13 `_setup_world_group_and_device`): initialise it here (LOCAL_RANK is 0 too)
        torch.cuda.init()  # type: ignore[no-untyped-call]
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cpu")
    mesh = init_device_mesh(device_type, MESH, mesh_dim_names=("replicate", "shard"))
    return mesh, device


def _model(mesh: Any, device_type: str, seed: int) -> tuple[torch.nn.Module, Any]:
    from slurm_guard.examples.tiny_llama import LlamaConfig, TinyLlama, shard_model

    torch.manual_seed(seed)
    model = shard_model(TinyLlama(LlamaConfig(**_sizes(device_type)[0])), mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _checked_config() -> Any:
    import slurm_guard as sg

    return sg.GuardConfig(replay_every=2, vote_every=2, abft=True, seed=7)


def _digest(guard: Any) -> str:
    h = hashlib.sha256()
    for t in guard.state_tensors():
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _fingerprint(guard: Any) -> str:
    from slurm_guard.fingerprint.tree import lanes_to_int

    return f"{lanes_to_int(guard.shard_fingerprint().tolist()):016x}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timing(mesh: Any, device_type: str, device: torch.device, root: Path, rounds: int) -> Any:
    """Plain FSDP2 against ShardedGuard, windows of K steps interleaved, slowest rank's mean."""
    import slurm_guard as sg

    rank = dist.get_rank()
    cfg, seq = _sizes(device_type)
    variants: dict[str, Any] = {
        "plain FSDP2": None,
        "ShardedGuard per-step checks + abft": sg.GuardConfig(
            replay_every=HUGE, vote_every=HUGE, abft=True, seed=1
        ),
        "ShardedGuard default + abft": sg.GuardConfig(abft=True, seed=1),
    }
    steps: dict[str, Any] = {}
    for i, (name, config) in enumerate(variants.items()):
        model, opt = _model(mesh, device_type, 0)
        if config is None:

            def plain(batch: torch.Tensor, m: Any = model, o: Any = opt) -> None:
                o.zero_grad(set_to_none=True)
                _loss(m, batch).backward()  # type: ignore[no-untyped-call]
                o.step()

            steps[name] = plain
        else:
            run_dir = root / f"timed-{i}"
            run_dir.mkdir(parents=True, exist_ok=True)
            steps[name] = sg.ShardedGuard(model, opt, _loss, run_dir, config).step
    counters = dict.fromkeys(steps, 0)
    times: dict[str, list[float]] = {name: [] for name in steps}

    def window(name: str, n: int) -> float:
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(n):
            steps[name](_batch(counters[name], rank, seq, cfg["vocab"], device))
            counters[name] += 1
        _sync(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / n])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed.item())

    names = list(steps)
    for name in names:  # warm-up, not measured
        window(name, 2)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(window(name, K))
    return times


def train(root: str, device_type: str, rounds: int) -> dict[str, Any]:
    """Launch 1: the checked guard's 6 steps and checkpoint, then the timing windows."""
    import slurm_guard as sg

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh, device = _setup(device_type)
        cfg, seq = _sizes(device_type)
        rank = dist.get_rank()
        model, opt = _model(mesh, device_type, 0)
        guard = sg.ShardedGuard(model, opt, _loss, Path(root) / "checked", _checked_config())
        losses, saved = [], ""
        began = time.perf_counter()
        for step in range(STEPS):
            losses.append(guard.step(_batch(step, rank, seq, cfg["vocab"], device)))
            if guard.step_count == SAVE_AT:
                guard.save_checkpoint()
                saved = _fingerprint(guard)
        _sync(device)
        result: dict[str, Any] = {
            "losses": losses,
            "digest": _digest(guard),
            "verified": list(guard.verified_steps),
            "fingerprint_at_save": saved,
            "checked_gemm_sites": len(guard.abft.names) if guard.abft is not None else 0,
            "checked_run_s": time.perf_counter() - began,
            "params": sum(p.numel() for p in model.parameters()),
            "param_device": str(next(model.parameters()).device),
        }
        if rounds:
            result["times_s"] = _timing(mesh, device_type, device, Path(root), rounds)
    result["determinism_warnings"] = sorted(
        {str(w.message)[:300] for w in caught if "determinis" in str(w.message)}
    )[:5]
    return result


def resume(root: str, device_type: str) -> dict[str, Any]:
    """Launch 2: another seed's model, resumed from the checkpoint, trained to the same step."""
    import slurm_guard as sg

    mesh, device = _setup(device_type)
    cfg, seq = _sizes(device_type)
    rank = dist.get_rank()
    model, opt = _model(mesh, device_type, 99)
    guard = sg.ShardedGuard(model, opt, _loss, Path(root) / "checked", _checked_config())
    start = guard.resume()
    resumed = _fingerprint(guard)
    losses = [
        guard.step(_batch(step, rank, seq, cfg["vocab"], device)) for step in range(start, STEPS)
    ]
    return {
        "start": start,
        "fingerprint_resumed": resumed,
        "losses": losses,
        "digest": _digest(guard),
    }


def _progress(line: str) -> None:
    """To stderr as it happens: the tail a timed-out part leaves says how far it got."""
    print(f"sharded part: {line}", file=sys.stderr, flush=True)


def _statuses(outcomes: list[Any]) -> str:
    return "ranks " + " ".join(o.status for o in outcomes)


def _errors(outcomes: list[Any]) -> list[str]:
    return [
        f"rank {o.rank} {o.status}: {str(o.value)[-1500:]}" for o in outcomes if o.status != "ok"
    ]


def sharded_part(device_type: str, rounds: int, budget: float) -> dict[str, Any]:
    """Both launches within `budget` seconds (the first may take two thirds: cold Triton
    compilation lands there); the figures and the checks' outcome as one JSON-able dict. A
    failure of the run itself (an error, an alarm, a rank that does not answer in time) comes
    back as ok False with the ranks' errors, never as an exception."""
    from _common import median

    from slurm_guard.local.launch import run_local

    # On CUDA each rank poses as its own node with one GPU (LOCAL_RANK 0; run_local gives each
    # rank its own SLURMD_NODENAME); cuBLAS's workspace fixed for run-to-run identical GEMMs.
    env = (
        {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        if device_type == "cuda"
        else {}
    )
    report: dict[str, Any] = {
        "ok": False,
        "backend": "gloo",
        "device": device_type,
        "world": WORLD,
        "mesh (replicas x shards)": list(MESH),
        "model": _sizes(device_type)[0],
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory(prefix="sg-sharded-") as root:
        began = start = time.perf_counter()
        first = run_local(
            train,
            WORLD,
            args=(root, device_type, rounds),
            nodes=NODES,
            extra_env=env,
            timeout=budget * 2 / 3,
        )
        report["train_launch_s"] = time.perf_counter() - began
        _progress(f"training launch: {report['train_launch_s']:.1f} s, {_statuses(first)}")
        if _errors(first):
            report["error"] = "training launch failed"
            report["errors"] = _errors(first)
            return report
        trained = [o.value for o in first]
        meta_path = Path(root, "checked", "checkpoints", f"step-{SAVE_AT:08d}", "meta.json")
        sealed = json.loads(meta_path.read_text())["shard_fingerprints"]
        began = time.perf_counter()
        second = run_local(
            resume,
            WORLD,
            args=(root, device_type),
            nodes=NODES,
            extra_env=env,
            timeout=max(budget - (time.perf_counter() - start), 5.0),
        )
        report["resume_launch_s"] = time.perf_counter() - began
        _progress(f"resume launch: {report['resume_launch_s']:.1f} s, {_statuses(second)}")
    head = trained[0]
    report.update(
        params=head["params"],
        param_device=head["param_device"],
        checked_gemm_sites=head["checked_gemm_sites"],
        verified_steps=head["verified"],
        checked_run_s=head["checked_run_s"],
        determinism_warnings=head["determinism_warnings"],
        sealed_shard_fingerprints=sealed,
    )
    # the HSDP replicas of each shard agree (ranks r and r + shards hold the same shard)
    shards = MESH[1]
    report["replicas_agree"] = all(
        trained[r]["digest"] == trained[r + shards]["digest"] for r in range(WORLD - shards)
    )
    if "times_s" in head:
        times = head["times_s"]
        plain = times["plain FSDP2"]
        report["rounds"], report["steps_per_window"] = len(plain), K
        report["median_step_ms"] = {n: 1e3 * median(ts) for n, ts in times.items()}
        report["median_ratio_to_plain"] = {
            n: median([t / p for t, p in zip(ts, plain, strict=True)]) for n, ts in times.items()
        }
        report["times_s"] = times
    if _errors(second):
        report["error"] = "resume launch failed"
        report["errors"] = _errors(second)
        return report
    resumed = [o.value for o in second]
    report["resumed_from_step"] = resumed[0]["start"]
    report["resume_reproduced_sealed_fingerprint"] = (
        [r["fingerprint_resumed"] for r in resumed]
        == sealed
        == [t["fingerprint_at_save"] for t in trained]
    )
    report["resume_bit_identical"] = all(
        r["losses"] == t["losses"][r["start"] :] and r["digest"] == t["digest"]
        for r, t in zip(resumed, trained, strict=True)
    )
    report["ok"] = bool(
        report["replicas_agree"]
        and report["resumed_from_step"] == SAVE_AT
        and report["resume_reproduced_sealed_fingerprint"]
        and report["resume_bit_identical"]
        and head["verified"]
    )
    return report


# ---------------------------------------------------------------- NCCL on one GPU: a probe


def _nccl_rank(rank: int, port: int, results: Any) -> None:
    """Two ranks on cuda:0 with NCCL, each posing as its own host (NCCL_HOSTID)."""
    import datetime

    os.environ.update(
        NCCL_HOSTID=f"sg-probe-host-{rank}",
        NCCL_SOCKET_IFNAME="lo",
        NCCL_IB_DISABLE="1",
        NCCL_NVLS_ENABLE="0",
        NCCL_MNNVL_ENABLE="0",
        NCCL_DEBUG="WARN",
    )
    try:
        torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=20),
            device_id=torch.device("cuda", 0),
        )
        x = torch.arange(4, dtype=torch.float32, device="cuda") + rank
        total = x.clone()
        dist.all_reduce(total)
        out = torch.empty(2, device="cuda")
        dist.reduce_scatter_tensor(out, x.clone(), op=dist.ReduceOp.AVG)
        gathered = torch.empty(8, device="cuda")
        dist.all_gather_into_tensor(gathered, x)
        torch.cuda.synchronize()
        right = (
            total.tolist() == [1.0, 3.0, 5.0, 7.0]
            and out.tolist() == ([0.5, 1.5] if rank == 0 else [2.5, 3.5])
            and gathered.tolist() == [0.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0]
        )
        dist.destroy_process_group()
        results.put((rank, "ok" if right else "wrong values", ""))
    except BaseException as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {str(exc)[-800:]}"))


def _nccl_version() -> str:
    if not torch.cuda.is_available():
        return ""
    version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def nccl_probe(timeout: float) -> dict[str, Any]:
    """Does NCCL run 2 ranks on one GPU when each poses as its own host? (unsupported by NCCL)"""
    from slurm_guard.local.launch import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                rank, status, text = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                break
            got[rank] = (status, text)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    statuses = [got.get(r, ("hung", f"no answer in {timeout:.0f} s"))[0] for r in range(2)]
    return {
        "ok": statuses == ["ok", "ok"],
        "how": "NCCL_HOSTID per rank, NCCL_SOCKET_IFNAME=lo: outside NCCL's support",
        "nccl": _nccl_version(),
        "ranks": {r: got.get(r, ("hung", ""))[0] for r in range(2)},
        "errors": [got[r][1] for r in sorted(got) if got[r][1]],
    }
