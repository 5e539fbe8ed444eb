"""False-alarm soak: long clean guarded trainings must raise no alarm at all.

Part 1 (exact mode): replay_every=1, vote_every=1, `--world` ranks each its own node; every step
gives `world` replay comparisons (each rank recomputes another node's microbatch) and one weight
vote over all replicas (`world` fingerprints compared). Counted from the ledger, not assumed.

Part 2 (tolerance mode): deterministic=False with a `replay-noise` fault on EVERY rank (relative
Gaussian noise of size `--noise` on every replayed gradient: stands in for non-deterministic
kernels); the tolerance is calibrated from the first replays. Zero alarms expected.

Part 3 (checked GEMMs, `--abft`): one process, no guard, fp32 on the CPU: TinyGPT and the
HuggingFace GPT-2 tiny config (a local GPT-2-shaped model with the same Conv1D layers when
transformers is not installed) train with AdamW and four microbatches per step, every GEMM
checked (`slurm_guard.abft`). Counts the checked GEMMs and the largest normalised residual
(residual / bound; a false alarm is > 1 on a step whose loss and gradients are finite). Zero
false alarms expected. A step with a non-finite loss or gradients is a diverged run, which a
guarded run would stop at its finite check first: counted apart, and the soak exits 2 (invalid)
rather than folding those failed checks into the false alarms.

    python benchmarks/soak.py --quick                  # 2 x 300 steps, ~2 min
    python benchmarks/soak.py                          # >= 20,000 comparisons + >= 1,000 replays
    python benchmarks/soak.py --abft-only              # >= 1,000,000 checked GEMMs, ~10 min
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from _common import RESULTS, environment, table  # noqa: E402
from workers import SMALL, run_scenarios  # noqa: E402

import slurm_guard as sg  # noqa: E402
from slurm_guard.local.launch import run_local  # noqa: E402
from slurm_guard.rundir.records import read_ledger  # noqa: E402


def count(run_dir: Path, world: int) -> dict[str, Any]:
    ledger = read_ledger(run_dir / "ledger.jsonl")
    replays = [e for e in ledger if e.check == "replay"]
    votes = [e for e in ledger if e.check == "vote"]
    failed = [e for e in ledger if not e.passed]
    alarms = sorted(p.name for p in (run_dir / "alarms").glob("*.json"))
    worst = max((float(e.detail.get("max_discrepancy", 0.0)) for e in replays), default=0.0)
    tolerance = [float(e.detail["tolerance"]) for e in replays if "tolerance" in e.detail]
    return {
        "verification_steps": len(replays),
        "replay_comparisons": sum(int(e.detail.get("comparisons", world)) for e in replays),
        "weight_votes": len(votes),
        "weight_fingerprints_compared": len(votes) * world,
        "failed_checks": len(failed),
        "alarms": alarms,
        "max_discrepancy": worst,
        "final_tolerance": tolerance[-1] if tolerance else None,
    }


def run_part(
    name: str, world: int, steps: int, config: sg.GuardConfig, base: Path
) -> dict[str, Any]:
    run_dir = base / name
    run_dir.mkdir()
    nodes = [f"node{i + 1}" for i in range(world)]
    scenario = {"run_dir": str(run_dir), "steps": steps, "config": config, "model": SMALL}
    began = time.monotonic()
    outcomes = run_local(run_scenarios, world, args=([scenario],), nodes=nodes, timeout=3600.0)
    seconds = time.monotonic() - began
    status = [o.status for o in outcomes]
    raised = [o.value[0]["alarm"] for o in outcomes if o.status == "ok" and o.value[0]["alarm"]]
    out = {"part": name, "world": world, "steps": steps, "seconds": seconds, "status": status}
    out.update(count(run_dir, world))
    out["alarms_raised"] = len(raised) + len(out["alarms"])
    losses = outcomes[0].value[0]["losses"] if status[0] == "ok" else []
    out["trained"] = bool(losses) and sum(losses[-10:]) < sum(losses[:10])
    return out


def _gpt2_tiny() -> tuple[Any, str]:
    """HF GPT-2 with a tiny config (transformers' own model), or None when not installed."""
    try:
        import transformers
    except ImportError:
        return None, "transformers not installed"
    config = transformers.GPT2Config(  # type: ignore[no-untyped-call]
        n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=96, attn_implementation="eager"
    )
    model = transformers.GPT2LMHeadModel(config)  # type: ignore[no-untyped-call]
    return model, f"transformers {transformers.__version__}"


FAILURES_KEPT = 50  # failed checks listed in the JSON (step, layer, pass, ratio), the first ones


def _finite_step(losses: list[Any], params: list[Any]) -> tuple[bool, float]:
    """(loss and every gradient finite, gradient norm): what a guarded run's finite check judges
    before any GEMM check, so a step failing it is a diverged run, not a false alarm."""
    import torch

    grads = [p.grad for p in params if p.grad is not None]
    finite = all(torch.isfinite(v).all() for v in losses) and all(
        bool(torch.isfinite(g).all()) for g in grads
    )
    norm = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads]))
    return finite, float(norm)


def abft_part(name: str, gemms: int, seed: int) -> dict[str, Any]:
    """Train until `gemms` checked GEMMs have run; every check's ratio must stay below 1.

    A soak measures the check's false alarms on a HEALTHY run. A step whose loss or gradients are
    not finite would stop a guarded run at its finite check (verdict `numerical`) before any GEMM
    check is judged, so such steps are counted apart (`nonfinite_steps`, with the checks that
    failed on them) and make the soak fail as a broken run; a check failing on a finite step is a
    false alarm and is counted as one (`false_alarms`), never folded into the other count.
    """
    import torch

    from slurm_guard.abft import PASSES, attach
    from slurm_guard.examples.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss, make_batch

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    cfg = TinyGPTConfig()
    if name == "tiny_gpt":
        model: Any = TinyGPT(cfg)
        source = f"TinyGPT {cfg}"

        def loss(batch: dict[str, Any]) -> Any:
            return lm_loss(model, batch)

        def batch_at(step: int, micro: int) -> dict[str, Any]:
            return make_batch(step, micro, cfg, batch_size=4)
    else:
        model, source = _gpt2_tiny()
        if model is None:
            return {"part": f"abft {name}", "skipped": source}

        def loss(batch: dict[str, Any]) -> Any:
            return model(input_ids=batch["ids"], labels=batch["ids"]).loss

        def batch_at(step: int, micro: int) -> dict[str, Any]:
            gen = torch.Generator().manual_seed(step * 7919 + micro)
            return {"ids": torch.randint(0, 96, (2, 32), generator=gen)}

    handle = attach(model)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    counted = false_alarms = failed_nonfinite = steps = nonfinite_steps = 0
    worst = 0.0  # over finite steps: the check's own figure
    per_pass = [0.0, 0.0, 0.0]
    failures: list[dict[str, Any]] = []
    first_losses: list[float] = []
    last_losses: list[float] = []
    max_grad_norm = 0.0
    began = time.monotonic()
    while counted < gemms:
        opt.zero_grad(set_to_none=True)
        losses = []
        for micro in range(4):
            value = loss(batch_at(steps, micro))
            value.backward()
            losses.append(value.detach())
        finite, grad_norm = _finite_step(losses, params)
        added = sum(len(s.results) for s in handle.sites)
        counted += added
        result = handle.collect()
        assert result is not None
        values = result.tolist()  # once per step
        for site, row in zip(handle.sites, values, strict=True):
            for which, ratio in enumerate(row):
                if ratio == -1.0:
                    continue
                if finite:
                    per_pass[which] = max(per_pass[which], ratio)
                    worst = max(worst, ratio)
                if ratio <= 1.0:
                    continue
                if finite:
                    false_alarms += 1
                else:
                    failed_nonfinite += 1
                failure = {
                    "step": steps,
                    "layer": site.name,
                    "pass": PASSES[which],
                    "ratio": ratio,
                    "finite_step": finite,
                }
                if len(failures) < FAILURES_KEPT:
                    failures.append(failure)
                if false_alarms + failed_nonfinite == 1:
                    print(f"abft {name}: FIRST FAILED CHECK {failure}", file=sys.stderr)
        mean_loss = float(torch.stack(losses).mean())
        if not finite:
            nonfinite_steps += 1
            if nonfinite_steps == 1:
                print(
                    f"abft {name}: NON-FINITE loss or gradients at step {steps} (loss "
                    f"{mean_loss}, gradient norm {grad_norm}): the run diverged; its failed "
                    "checks are counted apart, not as false alarms",
                    file=sys.stderr,
                )
        else:
            max_grad_norm = max(max_grad_norm, grad_norm)
        if len(first_losses) < 10:
            first_losses.append(mean_loss)
        last_losses = [*last_losses[-9:], mean_loss]
        opt.step()
        steps += 1
        if counted // 10_000 != (counted - added) // 10_000 or steps == 1:
            # progress on stderr: a long soak on a shared machine can be read while it runs
            print(
                f"abft {name}: {steps} steps, {counted} checked GEMMs, {false_alarms} false "
                f"alarms, {nonfinite_steps} non-finite steps, max residual/bound {worst:.3e}, "
                f"loss {mean_loss:.3f}, {time.monotonic() - began:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    return {
        "part": f"abft {name}",
        "model": source,
        "steps": steps,
        "microbatches_per_step": 4,
        "optimizer": "AdamW lr 3e-3, no clipping",
        "checked_gemms": counted,
        "false_alarms": false_alarms,
        "nonfinite_steps": nonfinite_steps,
        "checks_failed_on_nonfinite_steps": failed_nonfinite,
        "failures": failures,
        "max_normalised_residual": worst,
        "max_by_pass": dict(zip(PASSES, per_pass, strict=True)),
        "threshold": 1.0,
        "margin": handle.sites[0].margin,
        "block": handle.sites[0].block,
        "loss_first_10_steps": sum(first_losses) / max(len(first_losses), 1),
        "loss_last_10_steps": sum(last_losses) / max(len(last_losses), 1),
        "max_grad_norm": max_grad_norm,
        "seconds": time.monotonic() - began,
    }


def main_abft(gemms: int, out: Path | None, which: str) -> int:
    """Both models share `gemms` (60/40), or one model runs all of them (run the two as two
    processes on two cores and add the counts). Exit 1 on any false alarm, 2 when the run itself
    went non-finite (the soak then measured nothing)."""
    if which == "both":
        parts = [
            abft_part("tiny_gpt", gemms * 6 // 10, 0),
            abft_part("gpt2_tiny", gemms * 4 // 10, 1),
        ]
    else:
        parts = [abft_part(which, gemms, 0 if which == "tiny_gpt" else 1)]
    headers = [
        "part",
        "steps",
        "checked GEMMs",
        "false alarms",
        "non-finite steps",
        "max residual/bound",
        "seconds",
    ]
    rows = [
        [
            p["part"],
            p.get("steps", "-"),
            p.get("checked_gemms", "-"),
            p.get("false_alarms", "-"),
            p.get("nonfinite_steps", "-"),
            f"{p['max_normalised_residual']:.2e}" if "max_normalised_residual" in p else "-",
            round(p.get("seconds", 0)),
        ]
        for p in parts
    ]
    print(table(headers, rows))
    total = sum(p.get("checked_gemms", 0) for p in parts)
    alarms = sum(p.get("false_alarms", 0) for p in parts)
    diverged = sum(p.get("nonfinite_steps", 0) for p in parts)
    print(f"\n{total:,} checked GEMMs, {alarms} false alarms, {diverged} non-finite steps")
    path = out or RESULTS / f"soak_abft_{which}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"environment": environment(), "checked_gemms": total, "parts": parts}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"JSON: {path}", file=sys.stderr)
    if diverged:
        print(
            f"SOAK INVALID: {diverged} steps had a non-finite loss or gradients; a soak measures "
            "false alarms on a healthy run (fix the run: learning rate, clipping)",
            file=sys.stderr,
        )
        return 2
    return 1 if alarms else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="exact-mode steps (default 5000)")
    parser.add_argument("--noise-steps", type=int, default=None, help="default 1000")
    parser.add_argument("--noise", type=float, default=1e-5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--abft-only", action="store_true", help="only the checked-GEMM soak (part 3)"
    )
    parser.add_argument("--abft-gemms", type=int, default=1_000_000)
    parser.add_argument("--abft-model", choices=["both", "tiny_gpt", "gpt2_tiny"], default="both")
    args = parser.parse_args(argv)
    if args.abft_only:
        return main_abft(args.abft_gemms, args.json, args.abft_model)
    steps = args.steps or (300 if args.quick else 5000)
    noise_steps = args.noise_steps or (300 if args.quick else 1000)
    parts = []
    with tempfile.TemporaryDirectory(prefix="sg-soak-") as tmp:
        base = Path(tmp)
        exact = sg.GuardConfig(replay_every=1, vote_every=1)
        parts.append(run_part("exact", args.world, steps, exact, base))
        noise = tuple(
            sg.Fault("replay-noise", rank=r, step=0, persistent=True, factor=args.noise)
            for r in range(args.world)
        )
        tolerant = sg.GuardConfig(replay_every=1, vote_every=1, deterministic=False, faults=noise)
        parts.append(run_part("tolerance", args.world, noise_steps, tolerant, base))
    headers = [
        "part",
        "world",
        "steps",
        "replay comparisons",
        "weight votes",
        "failed checks",
        "alarms",
        "max discrepancy",
        "tolerance",
        "seconds",
    ]
    rows = [
        [
            p["part"],
            p["world"],
            p["steps"],
            p["replay_comparisons"],
            p["weight_votes"],
            p["failed_checks"],
            p["alarms_raised"],
            f"{p['max_discrepancy']:.2e}" if p["part"] == "tolerance" else "exact",
            f"{p['final_tolerance']:.2e}" if p["final_tolerance"] is not None else "-",
            round(p["seconds"]),
        ]
        for p in parts
    ]
    print(table(headers, rows))
    out = args.json or RESULTS / ("soak_quick.json" if args.quick else "soak.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {
        "model": f"TinyGPT {SMALL}",
        "noise": args.noise,
        "replay_every": 1,
        "vote_every": 1,
    }
    payload = {"environment": environment(), "settings": settings, "parts": parts}
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"JSON: {out}", file=sys.stderr)
    bad = any(
        p["alarms_raised"] or p["failed_checks"] or p["status"] != ["ok"] * p["world"]
        for p in parts
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
