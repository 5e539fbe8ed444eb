"""Step time of the HF Trainer with `GuardedTrainer` against the plain Trainer, interleaved.

Local gloo processes (2 by default) train the tiny GPT-2 of the integration tests (2 layers,
width 64, or `--width`) on random tokens, 2 microbatches of 2 rows per step. Variants: the plain
`transformers.Trainer`; `GuardedTrainer` with per-step checks only (replay and vote off); and
`GuardedTrainer` with the default `GuardConfig()` (replay and vote every 10 steps). Every round
runs each variant once, a fresh Trainer for `--steps` steps, in a rotating order; a callback
times each optimizer step (`on_step_begin` to `on_step_end`), the first 2 steps of a run left
out (set-up, first compiles). Per variant: the median over rounds of the mean step time, and
the median of each round's ratio to the plain Trainer of the same round.

    python benchmarks/hf_overhead.py               # 2 ranks, 5 rounds of 22 steps
    python benchmarks/hf_overhead.py --quick       # 2 rounds of 12 steps
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _framework_overhead import GUARD_VARIANTS, add_options, interleaved_means, run_and_report

import slurm_guard as sg

VOCAB, SEQ = 128, 16
VARIANTS: dict[str, sg.GuardConfig | None] = {"plain Trainer": None, **GUARD_VARIANTS}


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _one_run(name: str, root: Path, steps: int, width: int) -> list[float]:
    """One fresh Trainer of variant `name`; the time of each of its optimizer steps."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from slurm_guard.integrations.hf import GuardedTrainer

    times: list[float] = []
    began = [0.0]

    class Timer(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            began[0] = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter() - began[0])

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=width, vocab_size=VOCAB, n_positions=SEQ)
    args = TrainingArguments(
        output_dir=str(root / "out"),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        max_steps=steps,
        save_strategy="no",
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    common: dict[str, Any] = {
        "model": GPT2LMHeadModel(cfg),
        "args": args,
        "train_dataset": _Tokens(4 * steps * dist.get_world_size()),
        "callbacks": [Timer()],
    }
    config = VARIANTS[name]
    if config is None:
        trainer: Trainer = Trainer(**common)
    else:
        run_dir = root / "run"
        run_dir.mkdir(parents=True, exist_ok=True)  # every rank: one shared run dir
        trainer = GuardedTrainer(
            **common, guard_run_dir=str(run_dir), guard_config=config, guard_exit_on_alarm=False
        )
    trainer.train()
    return times


def _worker(rounds: int, steps: int, width: int, scratch: str) -> dict[str, list[float]]:
    return interleaved_means(list(VARIANTS), _one_run, rounds, steps, width, scratch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = add_options(parser).parse_args()
    title = f"HF Trainer, GPT-2 2 layers width {a.width}"
    run_and_report("hf_overhead", title, _worker, a)


if __name__ == "__main__":
    main()
