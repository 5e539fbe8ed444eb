"""The GPU check: one command, one GPU, under 8 minutes; JSON to benchmarks/results/gpu_check.json.

On a machine with CUDA it runs, each part in its own time budget so one hang cannot eat the rest:
1. the `gpu`-marked tests (real Triton compilation; CUDA vs CPU bit-identity of the kernels);
2. the GPU an alarm names: index, UUID and PCI bus id of every visible device, non-null and
   as `nvidia-smi` prints them (run.json and alarm records carry them);
   fingerprint bit-identity, CUDA (Triton NH) against CPU (C kernel), over sizes and dtypes;
3. bandwidth on the GPU: fingerprint and the fused bucket check against `torch.sum` and a copy
   of the same tensor (GB/s of input read; the copy also writes as much);
4. the snapshot copy (pinned buffer, copy stream) against a plain device-to-host copy, with
   matmuls running during it, and the sealed snapshot's bits against the device's;
5. the sharded guard (`_sharded_gpu.py`, 90 s): ShardedGuard on FSDP2 `fully_shard`, 4 ranks
   sharing the one GPU as a 2 x 2 HSDP mesh over gloo (NCCL refuses two ranks on one device;
   the reasons and sources are in `_sharded_gpu.py`), `abft=True`: replays of fingerprinted
   reduce-scatter inputs, the shard vote, checked GEMMs, a sealed DCP checkpoint resumed
   bit-identically by a second launch, and plain FSDP2 against ShardedGuard step times,
   interleaved; then a probe of NCCL with 2 ranks on the GPU, each posing as its own host
   (`NCCL_HOSTID`, outside NCCL's support; 40 s, reported, never relied on);
6. step overhead of a ~350M-parameter GPT (TinyGPT width 1024, 24 layers, context 512, batch 8)
   under DDP with NCCL at world size 1: plain DDP, per-step checks only (replay and vote off),
   the same judged by the fast path's all-reduces (`fast_path_world=1`), the same with every
   GEMM checked (`abft=True`, the checked-GEMM cost on a GPU) and the default
   configuration, interleaved windows of K = 10 steps.
Without CUDA it says so, runs its CPU-safe part (the Triton kernels under the interpreter against
their specifications, when Triton is installed) and exits 0.

    python benchmarks/gpu_check.py             # full check (needs one CUDA device)
    python benchmarks/gpu_check.py --quick     # fewer sizes and rounds
    python benchmarks/gpu_check.py --sharded-only               # part 5 alone, on the GPU
    python benchmarks/gpu_check.py --sharded-only --device cpu  # part 5's child on CPU tensors
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import median, table, write_json

REPO = Path(__file__).resolve().parent.parent
K = 10
BUDGET_S = {"interpreter": 120, "tests": 200, "steps": 220, "sharded": 90, "nccl_probe": 40}
CPU_SHARDED_BUDGET_S = 300  # the same child on CPU (gloo), for checks without a GPU


def _repo_first() -> dict[str, str]:
    """Children import this checkout's package even if another copy is installed."""
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    }


def _sub(args: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a part in a child process; its last stdout line is JSON. Never raises.

    The child leads its own process group, killed whole at the deadline: a part that spawns
    ranks (sharded) must not leave them holding the GPU for the parts after it."""
    began = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **_repo_first(), **(env or {})},
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        tail = (stdout + stderr)[-3000:]
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "tail": tail}
    lines = stdout.strip().splitlines()
    result: dict[str, Any] = {"returncode": proc.returncode}
    try:
        result.update(json.loads(lines[-1]))
    except (IndexError, ValueError):
        result["tail"] = (stdout + stderr)[-3000:]
    result.setdefault("ok", proc.returncode == 0)
    result["seconds"] = time.perf_counter() - began
    return result


# ---------------------------------------------------------------- part: interpreter (CPU-safe)


def interpreter_part() -> dict[str, Any]:
    """The Triton kernels on CPU tensors under TRITON_INTERPRET=1, against their specifications."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return {"ok": True, "skipped": "triton not installed (pip install slurm-guard[gpu])"}
    from slurm_guard.fingerprint import nh as ff
    from slurm_guard.fingerprint.tree import as_int
    from slurm_guard.kernels import sketch as sk
    from slurm_guard.kernels import triton_kernels as tk

    assert tk.interpreting(), "set TRITON_INTERPRET=1 before the kernels are defined"
    fp = ff.FastFingerprinter(20240601)
    words = sk.seed_words(20240601)
    mismatches = []
    for n in (0, 1, 4095, 4097, 70_001):
        t = torch.randn(n, generator=torch.Generator().manual_seed(n))
        if as_int(ff.triton_fingerprint(t, fp, fp._keys)) != as_int(fp.tensor(t)):
            mismatches.append(f"fingerprint n={n}")
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            x = t.to(dtype)
            a, b = tk.triton_check(x, words), sk.reference_check(x, words)
            if not torch.equal(a.view(torch.int64), b.view(torch.int64)):
                mismatches.append(f"bucket check n={n} {dtype}")
    return {"ok": not mismatches, "mismatches": mismatches, "cases": 5 * 5}


# ---------------------------------------------------------------- part: CUDA identity, bandwidth


def identity_part(quick: bool) -> dict[str, Any]:
    from slurm_guard.fingerprint import nh as ff
    from slurm_guard.fingerprint.tree import as_int
    from slurm_guard.kernels import bucket as kb
    from slurm_guard.kernels import sketch as sk

    fp = ff.FastFingerprinter(7)
    words = sk.seed_words(7)
    cases, mismatches = 0, []
    sizes = [0, 1, 1023, 4096, 4097, 1_000_003] + ([] if quick else [50_000_017])
    for n in sizes:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
            t = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 9).to(dtype)
            cases += 1
            if as_int(fp.tensor(t.cuda())) != as_int(fp.tensor(t)):
                mismatches.append(f"fingerprint n={n} {dtype}")
            if dtype.is_floating_point:
                cases += 1
                a, b = kb.bucket_check(t.cuda(), words).cpu(), kb.bucket_check(t, words)
                if not torch.equal(a.view(torch.int64), b.view(torch.int64)):
                    mismatches.append(f"bucket check n={n} {dtype}: {a.tolist()} {b.tolist()}")
            if dtype == torch.float32:  # the averaged bucket: divided in place, then sketched
                for divisor in (3, 8):
                    cases += 1
                    on_gpu, on_cpu = t.cuda(), t.clone()
                    a = kb.bucket_check(on_gpu, words, l1=False, divide_by=divisor).cpu()
                    b = kb.bucket_check(on_cpu, words, l1=False, divide_by=divisor)
                    same_sketch = torch.equal(a.view(torch.int64), b.view(torch.int64))
                    if not (
                        same_sketch
                        and torch.equal(on_gpu.cpu().view(torch.int32), on_cpu.view(torch.int32))
                    ):
                        mismatches.append(f"divided bucket check n={n} / {divisor}")
    return {
        "ok": not mismatches,
        "cases": cases,
        "mismatches": mismatches,
        "fingerprint_backend_cuda": "triton"
        if ff._use_triton(torch.empty(1, device="cuda"))
        else "torch",
        "bucket_check_backend_cuda": kb.backend(torch.device("cuda")),
    }


def gpu_identity_part(quick: bool) -> dict[str, Any]:
    """The GPU an alarm names (run.json, alarm records): index, UUID and PCI bus id of each
    visible device, non-null, as the rank gather carries them, and as nvidia-smi prints them."""
    import re
    import shutil

    from slurm_guard.comm.devices import gpu_identity
    from slurm_guard.comm.topology import _decode_gpu, _encode_gpu

    del quick
    problems, seen = [], []
    smi: dict[int, tuple[str, str]] = {}
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        for line in out.splitlines():
            index, uuid, pci = (x.strip() for x in line.split(","))
            smi[int(index)] = (uuid, pci.upper())
    for i in range(torch.cuda.device_count()):
        gpu = gpu_identity(torch.device("cuda", i))
        seen.append(None if gpu is None else gpu.__dict__)
        if gpu is None or gpu.index != i:
            problems.append(f"cuda:{i}: {gpu}")
            continue
        if gpu.uuid is None or not gpu.uuid.startswith(("GPU-", "MIG-")):
            problems.append(f"cuda:{i}: uuid {gpu.uuid!r}")
        pci_form = r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.0"
        if gpu.pci_bus_id is None or not re.fullmatch(pci_form, gpu.pci_bus_id):
            problems.append(f"cuda:{i}: pci_bus_id {gpu.pci_bus_id!r}")
        if _decode_gpu(_encode_gpu(gpu)) != gpu:
            problems.append(f"cuda:{i}: the rank gather's encoding changes it")
        listed = smi.get(gpu.node_index) if gpu.node_index is not None else None
        if listed is not None and listed != (gpu.uuid, gpu.pci_bus_id):
            problems.append(f"cuda:{i}: nvidia-smi says {listed}")
    return {
        "ok": not problems and bool(seen),
        "problems": problems,
        "gpus": seen,
        "nvidia_smi": bool(smi),
    }


def _cuda_time(fn: Any, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return median(times)


def bandwidth_part(quick: bool) -> dict[str, Any]:
    from slurm_guard.fingerprint import nh as ff
    from slurm_guard.kernels import bucket as kb
    from slurm_guard.kernels import sketch as sk

    fp = ff.FastFingerprinter(7)
    words = sk.seed_words(7)
    records = []
    sizes = [10**6, 10**7, 10**8] + ([] if quick else [10**9])
    for n in sizes:
        x = torch.randn(n, device="cuda")
        y = torch.empty_like(x)
        nbytes = n * 4
        variants = {
            "sum": lambda x=x: x.sum(),
            "copy": lambda x=x, y=y: y.copy_(x),
            "fingerprint": lambda x=x: fp.tensor(x),
            "bucket check": lambda x=x: kb.bucket_check(x, words),
        }
        if n <= 10**7:
            variants["bucket check (torch spec)"] = lambda x=x: sk.reference_check(x, words)
        reps = 5 if quick else 15
        times = {name: _cuda_time(fn, reps) for name, fn in variants.items()}
        for name, sec in times.items():
            records.append(
                {
                    "elements": n,
                    "variant": name,
                    "seconds": sec,
                    "gb_per_s_read": nbytes / sec / 1e9,
                    "x_sum": times["sum"] / sec,
                }
            )
        del x, y
        torch.cuda.empty_cache()
    return {"ok": True, "records": records}


def snapshot_part(quick: bool) -> dict[str, Any]:
    """The snapshot copy (pinned buffers, a copy stream) against the plain device-to-host copy.

    Also: does training work on the default stream overlap the copy, and does the sealed
    snapshot hold the bits the device held when the snapshot started?
    """
    import tempfile

    from slurm_guard.core.snapshot_copy import SnapshotCopier
    from slurm_guard.rundir.snapshots import SnapshotStore

    n = 64 * 2**20 if quick else 256 * 2**20  # float32 elements: 256 MiB or 1 GiB
    x = torch.randn(n, device="cuda")
    nbytes = n * 4
    pinned = torch.empty(n, pin_memory=True)
    plain = _cuda_time(lambda: pinned.copy_(x, non_blocking=True), 5)
    a = torch.randn(4096, 4096, device="cuda")
    matmuls = _cuda_time(lambda: [a @ a for _ in range(20)], 3)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        copier = SnapshotCopier(SnapshotStore(Path(d), "gpu-check", 0), torch.device("cuda"))
        seal = {"run_id": "r", "weight_fingerprint": "0", "fingerprint_seed": 1, "world_size": 1}
        expected = x.cpu()
        copier.start({"w": x}, step=1, **seal)  # warm-up: allocates the pinned buffer
        copier.wait()
        torch.cuda.synchronize()
        began = time.perf_counter()
        copier.start({"w": x}, step=2, **seal)
        returned = time.perf_counter() - began
        overlapped = _cuda_time(lambda: [a @ a for _ in range(20)], 1)
        copier.fence()
        x.add_(1.0)  # the next update, ordered after the copy by the fence
        copier.wait()
        copy_s = copier.stats.seconds_written[-1]
        store = copier.store
        newest = store.seals()[0][0]
        same = bool(torch.equal(store.load(newest)["w"], expected))
        copier.close()
    return {
        "ok": same and copier.stats.failed == 0,
        "bytes": nbytes,
        "plain_d2h_gb_per_s": nbytes / plain / 1e9,
        "snapshot_start_ms": returned * 1e3,
        "snapshot_copy_to_seal_gb_per_s": nbytes / copy_s / 1e9,
        "matmuls_ms": matmuls * 1e3,
        "matmuls_during_copy_ms": overlapped * 1e3,
        "bit_identical": same,
    }


# ---------------------------------------------------------------- part: step overhead (NCCL)


def steps_part(rounds: int) -> dict[str, Any]:
    import tempfile

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import slurm_guard as sg
    from slurm_guard.examples.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss, make_batch
    from slurm_guard.local.launch import free_port

    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = TinyGPTConfig(vocab=50304, context=512, width=1024, heads=16, layers=24, dropout=0.0)
    batch_size = 8
    os.environ.setdefault("SLURMD_NODENAME", "gpu-node")
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    huge = 1_000_000
    variants: dict[str, sg.GuardConfig | None] = {
        "plain DDP": None,
        "per-step checks": sg.GuardConfig(replay_every=huge, vote_every=huge),
        # the fast path's SUM and MAX all-reduces on NCCL (at 1 rank it is otherwise off)
        "per-step checks, fast path": sg.GuardConfig(
            replay_every=huge, vote_every=huge, fast_path_world=1
        ),
        "per-step checks + abft": sg.GuardConfig(replay_every=huge, vote_every=huge, abft=True),
        "default": sg.GuardConfig(),
    }
    runners: dict[str, Any] = {}
    params = 0
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="sg-gpu-") as root:
        for i, (name, config) in enumerate(variants.items()):
            torch.manual_seed(0)
            model = TinyGPT(cfg).cuda()
            params = sum(p.numel() for p in model.parameters())
            ddp = DDP(model, device_ids=[0])
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-5, fused=True)
            if config is None:

                def plain(batch: Any, ddp: DDP = ddp, opt: torch.optim.Optimizer = opt) -> None:
                    opt.zero_grad(set_to_none=True)
                    lm_loss(ddp, batch).backward()  # type: ignore[no-untyped-call]
                    opt.step()

                runners[name] = plain
            else:
                run_dir = Path(root) / f"v{i}"
                run_dir.mkdir()
                try:
                    runners[name] = sg.Guard(ddp, opt, lm_loss, run_dir, config=config).step
                except Exception as exc:  # a GPU-path bug: report it, measure the rest
                    errors[name] = f"{type(exc).__name__}: {exc}"
        steps = dict.fromkeys(runners, 0)

        def batch(step: int) -> dict[str, torch.Tensor]:
            return {k: v.cuda() for k, v in make_batch(step, 0, cfg, batch_size).items()}

        def window(name: str) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(K):
                runners[name](batch(steps[name]))
                steps[name] += 1
            torch.cuda.synchronize()
            return (time.perf_counter() - start) / K

        times: dict[str, list[float]] = {name: [] for name in runners}
        for name in list(runners):  # warm-up (and the first Triton compilations)
            try:
                window(name)
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
                del runners[name]
        names = list(runners)
        plain_module = TinyGPT(cfg).cuda()
        fb = []
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(window(name))
            torch.cuda.synchronize()
            start = time.perf_counter()
            lm_loss(plain_module, batch(r)).backward()  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
            fb.append(time.perf_counter() - start)
            plain_module.zero_grad(set_to_none=True)
    dist.destroy_process_group()
    plain_s = median(times["plain DDP"]) if times.get("plain DDP") else float("nan")
    floor = 1 + median(fb) / (K * plain_s)
    ratios = {name: median(ts) / plain_s for name, ts in times.items() if ts}
    return {
        "ok": not errors,
        "errors": errors,
        "params": params,
        "model": cfg.__dict__,
        "batch": batch_size,
        "rounds": rounds,
        "median_step_s": {name: median(ts) for name, ts in times.items() if ts},
        "ratio": ratios,
        "replay_fwd_bwd_s": median(fb),
        "floor": floor,
        "raw_window_means_s": times,
    }


# ---------------------------------------------------------------- driver


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    parser.add_argument("--json", default=None, help="output path (default benchmarks/results/)")
    parser.add_argument(
        "--part", choices=["interpreter", "steps", "sharded", "nccl-probe"], help=argparse.SUPPRESS
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--sharded-only",
        action="store_true",
        help="only the sharded guard part (4 ranks, gloo, one device)",
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="with --sharded-only: cpu runs the same child on CPU tensors (a check without a GPU)",
    )
    args = parser.parse_args()
    if args.part == "interpreter":
        print(json.dumps(interpreter_part()))
        return 0
    if args.part == "steps":
        print(json.dumps(steps_part(args.rounds or 3)))
        return 0
    if args.part == "sharded":
        from _sharded_gpu import sharded_part

        # run_local's own deadlines end 5 s before the parent kills this child: lost ranks
        # are then reported as such, with whatever the others said
        budget = BUDGET_S["sharded"] if args.device == "cuda" else CPU_SHARDED_BUDGET_S
        print(json.dumps(sharded_part(args.device, args.rounds or 0, budget - 5), default=str))
        return 0
    if args.part == "nccl-probe":
        from _sharded_gpu import nccl_probe

        print(json.dumps(nccl_probe(BUDGET_S["nccl_probe"] - 10)))
        return 0
    if args.sharded_only:
        return _sharded_only(args.device, args.rounds, args.json)

    began = time.perf_counter()
    report: dict[str, Any] = {"cuda": torch.cuda.is_available()}
    report["interpreter"] = _sub(
        [__file__, "--part", "interpreter"], BUDGET_S["interpreter"], {"TRITON_INTERPRET": "1"}
    )
    print(f"interpreter checks (CPU): {_summary(report['interpreter'])}")
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: GPU parts skipped (the CPU-safe part ran above)")
        report["skipped"] = "no CUDA device"
        path = write_json("gpu_check_cpu_only", report, args.json)
        print(f"wrote {path}")
        return 0 if report["interpreter"].get("ok") else 1

    report["device"] = torch.cuda.get_device_name(0)
    print(f"device: {report['device']}")
    parts_now = (
        ("gpu_identity", gpu_identity_part),
        ("identity", identity_part),
        ("bandwidth", bandwidth_part),
        ("snapshot", snapshot_part),
    )
    for name, part in parts_now:
        try:
            report[name] = part(args.quick)
        except Exception as exc:
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {_summary(report[name])}")
    if "records" in report["bandwidth"]:
        rows = [
            (f"{r['elements']:.0e}", r["variant"], r["gb_per_s_read"], r["x_sum"])
            for r in report["bandwidth"]["records"]
        ]
        print(table(["elements", "variant", "GB/s read", "x sum"], rows))
    snap = report["snapshot"]
    if "bytes" in snap:
        print(
            f"snapshot of {snap['bytes'] / 2**20:.0f} MiB: start() returned in "
            f"{snap['snapshot_start_ms']:.2f} ms; copy to seal "
            f"{snap['snapshot_copy_to_seal_gb_per_s']:.1f} GB/s (plain pinned D2H "
            f"{snap['plain_d2h_gb_per_s']:.1f} GB/s); 20 matmuls {snap['matmuls_ms']:.1f} ms "
            f"alone, {snap['matmuls_during_copy_ms']:.1f} ms during the copy; "
            f"bit-identical: {snap['bit_identical']}"
        )
    report["tests"] = _pytest_gpu(BUDGET_S["tests"])
    print(f"gpu-marked tests: {_summary(report['tests'])}")
    report.update(_sharded("cuda", args.rounds or (2 if args.quick else 3)))
    rounds = args.rounds or (2 if args.quick else 3)
    report["steps"] = _sub(
        [__file__, "--part", "steps", "--rounds", str(rounds)], BUDGET_S["steps"]
    )
    print(f"step overhead: {_summary(report['steps'])}")
    report["seconds"] = time.perf_counter() - began
    path = write_json("gpu_check", report, args.json)
    print(f"wrote {path} ({report['seconds']:.0f} s)")
    parts = (
        "interpreter",
        "gpu_identity",
        "identity",
        "bandwidth",
        "snapshot",
        "tests",
        "sharded",
        "steps",
    )
    return 0 if all(report[p].get("ok") for p in parts) else 1


def _sharded(device: str, rounds: int) -> dict[str, dict[str, Any]]:
    """The sharded part (and, on CUDA, the NCCL one-GPU probe), each a child with a budget."""
    budget = BUDGET_S["sharded"] if device == "cuda" else CPU_SHARDED_BUDGET_S
    part = _sub(
        [__file__, "--part", "sharded", "--device", device, "--rounds", str(rounds)], budget
    )
    out = {"sharded": part}
    print(f"sharded guard ({device}, gloo, 4 ranks, HSDP 2 x 2, abft): {_sharded_summary(part)}")
    if device == "cuda":
        out["nccl_probe"] = _sub([__file__, "--part", "nccl-probe"], BUDGET_S["nccl_probe"])
        print(f"NCCL, 2 ranks on one GPU (probe, not relied on): {_summary(out['nccl_probe'])}")
    return out


def _sharded_summary(part: dict[str, Any]) -> str:
    if not part.get("ok"):
        return _summary(part)
    ms = part.get("median_step_ms", {})
    ratio = part.get("median_ratio_to_plain", {})
    steps = "; ".join(f"{n} {ms[n]:.1f} ms/step ({ratio[n]:.2f}x)" for n in ms)
    return (
        f"ok: replays passed at steps {part['verified_steps']}, replicas agree, "
        f"{part['checked_gemm_sites']} checked Linear sites, resumed from step "
        f"{part['resumed_from_step']} bit-identical with the sealed shard fingerprints; {steps}"
    )


def _sharded_only(device: str, rounds: int | None, json_path: str | None) -> int:
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: sharded part skipped (--device cpu runs it on CPU)")
        return 0
    report: dict[str, Any] = {"cuda": torch.cuda.is_available(), "sharded_only": device}
    report.update(
        _sharded(device, rounds if rounds is not None else (3 if device == "cuda" else 1))
    )
    path = write_json(f"gpu_check_sharded_{device}", report, json_path)
    print(f"wrote {path}")
    return 0 if report["sharded"].get("ok") else 1


def _pytest_gpu(timeout: float) -> dict[str, Any]:
    began = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests"]
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env={**os.environ, **_repo_first()},
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    return {
        "ok": proc.returncode == 0,
        "returncode": proc.returncode,
        "summary": lines[-1] if lines else "",
        "tail": proc.stdout[-3000:] if proc.returncode else "",
        "seconds": time.perf_counter() - began,
    }


def _summary(part: dict[str, Any]) -> str:
    if part.get("skipped"):
        return f"skipped ({part['skipped']})"
    keys = ("summary", "error", "mismatches", "ratio", "errors", "floor", "cases", "tail")
    shown = {k: part[k] for k in keys if part.get(k)}
    return ("ok " if part.get("ok") else "FAILED ") + json.dumps(shown, default=str)[:1500]


if __name__ == "__main__":
    sys.exit(main())
