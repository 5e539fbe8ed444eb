"""Step time of PyTorch Lightning with `GuardCallback` against the same Trainer without it.

Local gloo processes (2 by default) train a tiny GPT (`slurm_guard.examples.TinyGPT`: 2 layers,
width 64 or `--width`, context 16, vocabulary 128, dropout on, AdamW, `gradient_clip_val=1.0`)
inside a LightningModule on random tokens, 2 microbatches of 2 rows per step
(`accumulate_grad_batches=2`), the shape of benchmarks/hf_overhead.py's GPT-2. Variants: the
Lightning Trainer with `strategy="ddp"`; the same with `GuardCallback` and per-step checks only
(replay and vote off); and with the default `GuardConfig()` (replay and vote every 10 steps).
Every round runs each variant once, a fresh Trainer for `--steps` steps, in a rotating order; a
callback times each optimizer step (the first microbatch's `on_train_batch_start` to the last
one's `on_train_batch_end`, which include the optimizer step), the first 2 steps of a run left
out. Per variant: the median over rounds of the mean step time, and the median of each round's
ratio to the Trainer without the guard in the same round.

    python benchmarks/lightning_overhead.py            # 2 ranks, 5 rounds of 22 steps
    python benchmarks/lightning_overhead.py --quick    # 2 rounds of 12 steps
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
from slurm_guard.examples.tiny_gpt import TinyGPT, TinyGPTConfig

VOCAB, SEQ, BATCH, ACCUMULATION = 128, 16, 2, 2
VARIANTS: dict[str, sg.GuardConfig | None] = {"plain Lightning": None, **GUARD_VARIANTS}


def _one_run(name: str, root: Path, steps: int, width: int) -> list[float]:
    """One fresh Lightning Trainer of variant `name`; the time of each of its optimizer steps."""
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from lightning.pytorch.strategies import DDPStrategy

    from slurm_guard.integrations.lightning import GuardCallback

    class LM(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            cfg = TinyGPTConfig(vocab=VOCAB, context=SEQ, width=width, heads=2, layers=2)
            self.gpt = TinyGPT(cfg)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            logits = self.gpt(tokens[:, :-1])
            return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    times: list[float] = []
    began = [0.0]

    class Timer(pl.Callback):  # type: ignore[misc]
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            if i % ACCUMULATION == 0:
                began[0] = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, out: Any, b: Any, i: int) -> None:
            if (i + 1) % ACCUMULATION == 0:
                times.append(time.perf_counter() - began[0])

    torch.manual_seed(0)
    rows = BATCH * ACCUMULATION * steps * dist.get_world_size()
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens), batch_size=BATCH, shuffle=False
    )
    callbacks: list[Any] = [Timer()]
    config = VARIANTS[name]
    if config is not None:
        run_dir = root / "run"
        run_dir.mkdir(parents=True, exist_ok=True)  # every rank: one shared run dir
        callbacks.append(GuardCallback(run_dir, config, exit_on_alarm=False))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=steps,
        accumulate_grad_batches=ACCUMULATION,
        gradient_clip_val=1.0,
        default_root_dir=str(root / "out"),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(LM(), train_dataloaders=loader)
    return times


def _worker(rounds: int, steps: int, width: int, scratch: str) -> dict[str, list[float]]:
    return interleaved_means(list(VARIANTS), _one_run, rounds, steps, width, scratch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = add_options(parser).parse_args()
    title = f"Lightning, TinyGPT 2 layers width {a.width}"
    run_and_report("lightning_overhead", title, _worker, a)


if __name__ == "__main__":
    main()
