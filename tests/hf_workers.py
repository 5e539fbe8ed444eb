"""HF Trainer runs for tests/test_integration_hf.py, on real gloo processes (spawned).

A tiny GPT-2 (2 layers, width 64, dropout on), random token data made from a fixed seed, 3
ranks, 2 microbatches per step: nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from framework_results import listing, state_sha

import slurm_guard as sg

VOCAB, SEQ, WIDTH = 128, 16, 64


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random token rows from a fixed seed. With `nan_at=(rank, k)` rows are served as embeddings,
    and the k-th row that rank serves holds a NaN: counted as served, not by index, so the sampler's
    shuffled order cannot move it past the end of a short run."""

    def __init__(self, n: int = 240, nan_at: tuple[int, int] | None = None) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.embeds = torch.randn(n, SEQ, WIDTH, generator=g) if nan_at is not None else None
        self.nan_at = nan_at
        self.served = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        served, self.served = self.served, self.served + 1
        if self.embeds is None:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}
        embeds = self.embeds[i]
        if self.nan_at == (dist.get_rank(), served):
            embeds = embeds.clone()
            embeds[3, 5] = float("nan")
        return {"inputs_embeds": embeds, "labels": self.ids[i]}


def train(
    out: str,
    run_dir: str,
    max_steps: int,
    config: sg.GuardConfig | None = None,
    *,
    guarded: bool = True,
    save_steps: int = 0,
    nan_at: tuple[int, int] | None = None,
    accumulation: int = 2,
    exit_on_alarm: bool | None = False,
    save_total_limit: int | None = None,
) -> dict[str, Any]:
    """One Trainer run (resuming from what the guard trusts); the final state's hash.

    `exit_on_alarm` is GuardedTrainer's `guard_exit_on_alarm`: False raises the alarm to the
    caller (run_local reports it), None keeps the integration's default (exit 86 under Slurm).
    """
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from slurm_guard.integrations.hf import GuardedTrainer

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=WIDTH, vocab_size=VOCAB, n_positions=SEQ)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(
        output_dir=out,
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        max_grad_norm=1.0,
        max_steps=max_steps,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        save_total_limit=save_total_limit,
        logging_steps=1,
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        lr_scheduler_type="linear",
        learning_rate=1e-3,
        ddp_find_unused_parameters=False,
    )
    data = Tokens(nan_at=nan_at)
    logged: list[dict[str, float]] = []
    if guarded:
        trainer: Trainer = GuardedTrainer(
            model=model,
            args=args,
            train_dataset=data,
            guard_run_dir=run_dir,
            guard_config=config,
            guard_exit_on_alarm=exit_on_alarm,
        )
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data)
    start: list[Any] = [-1, None]
    orig_log = trainer.log

    def log(logs: dict[str, float], *a: Any, **k: Any) -> None:
        logged.append(dict(logs))
        orig_log(logs, *a, **k)

    trainer.log = log  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        chosen = getattr(trainer, "_guard_chosen", None)
        start[0] = -1 if chosen is None else chosen.step
        start[1] = None if chosen is None or chosen.path is None else str(chosen.path)
    return {
        "sha": state_sha(trainer.model),  # type: ignore[arg-type]
        "global_step": trainer.state.global_step,
        "resumed_from": start[0],
        "resumed_path": start[1],
        "grad_norms": [x["grad_norm"] for x in logged if "grad_norm" in x],
        "rank": dist.get_rank(),
    }


def clean_and_nan(root: str) -> dict[str, Any]:
    """A clean 8-step run and a run in which node3 (rank 2) is served one NaN sample in step 2
    (2 rows a microbatch, 2 microbatches a step: rows 8-11), in one process group."""
    config = sg.GuardConfig(replay_every=3, schedule="fixed")
    clean = train(f"{root}/clean-out", f"{root}/clean-run", 8, config)
    plain = train(f"{root}/plain-out", f"{root}/plain-run", 8, guarded=False)
    try:
        train(f"{root}/nan-out", f"{root}/nan-run", 4, config, nan_at=(2, 9))
        nan: Any = None
    except sg.SilentDataCorruption as exc:
        nan = exc.alarm.to_json()
    return {"clean": clean, "plain": plain, "nan": nan}


def faulty(root: str) -> dict[str, Any]:
    """A persistent gradient fault on node3 from step 4; a checkpoint after every step."""
    fault = sg.Fault(kind="grad-scale", node="node3", step=4, persistent=True)
    config = sg.GuardConfig(replay_every=3, schedule="fixed", trust_replays=1, faults=(fault,))
    return train(f"{root}/fault-out", f"{root}/fault-run", 8, config, save_steps=1)


NO_CHANGE_FAULT = sg.Fault(kind="grad-scale", node="node2", step=5, factor=1.0)
"""Rides along in `resumed`: changes no value (training stays bit-identical), so the end of
the run must say `changed no value` (the integration's end_run)."""


def resumed(root: str) -> dict[str, Any]:
    """The requeued job (without the faulty node): resumes from what the guard trusts, with
    `trust_replays=1` checkpoint-3 (the passing replay at 3 vouches for it; the default 2 would
    trust only step 0, and a start from scratch would hide a resume that is not bit-identical)."""
    config = sg.GuardConfig(
        replay_every=3, schedule="fixed", trust_replays=1, faults=(NO_CHANGE_FAULT,)
    )
    return train(f"{root}/fault-out", f"{root}/fault-run", 8, config, save_steps=1)


def rotated_faulty(root: str) -> dict[str, Any]:
    """docs/integrations/hf.md's advice taken (issue 34): a checkpoint after every step,
    `save_total_limit=2`, a replay every 2 steps and the default `trust_replays=2`; a
    persistent fault on node2 from step 5, caught by the replay at step 6, which trusts only
    checkpoint-2: the Trainer's rotation alone would have deleted it by then."""
    fault = sg.Fault(kind="grad-scale", node="node2", step=5, persistent=True)
    config = sg.GuardConfig(replay_every=2, schedule="fixed", faults=(fault,))
    out, run = f"{root}/rot-out", f"{root}/rot-run"
    return train(out, run, 8, config, save_steps=1, save_total_limit=2)


def rotated_resumed(root: str) -> dict[str, Any]:
    """The rerun without the fault."""
    config = sg.GuardConfig(replay_every=2, schedule="fixed")
    out, run = f"{root}/rot-out", f"{root}/rot-run"
    return train(out, run, 8, config, save_steps=1, save_total_limit=2)


def refused_resumes(root: str) -> dict[str, Any]:
    """Checkpoints a resume may not load, each an error on every rank (issue 34): the same
    output_dir with a new guard_run_dir (another run's seals), then every allowed checkpoint
    damaged (one flipped bit in model.safetensors)."""
    config = sg.GuardConfig(replay_every=2, schedule="fixed")
    out = f"{root}/out"
    train(out, f"{root}/run", 3, config, save_steps=1)
    errors: dict[str, Any] = {}
    for case, run_dir in (("foreign", f"{root}/other-run"), ("damaged", f"{root}/run")):
        if case == "damaged" and dist.get_rank() == 0:
            for folder in Path(out).glob("checkpoint-*"):
                weights = folder / "model.safetensors"
                data = bytearray(weights.read_bytes())
                data[-10] ^= 1
                weights.write_bytes(bytes(data))
        dist.barrier()
        try:
            train(out, run_dir, 5, config, save_steps=1)
            errors[case] = None
        except sg.GuardError as exc:
            errors[case] = str(exc)
    errors["left"] = checkpoints(out)
    return errors


def checkpoints(path: str) -> list[str]:
    return listing(path, "checkpoint-*")
