"""nanoGPT's train.py loop ported to the guard as docs/user-guide.md "Porting your loop" says, for
`slurm-guard local -n 3` (test_nanogpt_loop.py): gradient accumulation, `max_grad_norm=1.0`,
a cosine LambdaLR with warmup and a best-val-loss holder in `stateful`, eval then save then
train, a disabled GradScaler, batches from the global RNG.

With NANOGPT_KEEP_LOOP=1 it is the other port of that section: nanoGPT's own loop kept
(`require_backward_grad_sync`, `clip_grad_norm_`, `scaler.step`) around `capture` / `check` /
`after_update`.

Usage: nanogpt_loop.py RUN_DIR RESULTS_DIR MAX_ITERS [NAN_STEP NAN_RANK]. Each rank writes its
losses and final weights to RESULTS_DIR/rank-<r>.pt when the run ends, by an alarm too.
"""

from __future__ import annotations

import math
import os
import sys
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import slurm_guard as sg
from slurm_guard.examples.tiny_gpt import TinyGPT, TinyGPTConfig

out_dir, results_dir, max_iters = sys.argv[1], sys.argv[2], int(sys.argv[3])
nan_at = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else None
eval_interval, eval_iters, always_save_checkpoint = 3, 2, True
gradient_accumulation_steps, batch_size, block_size, vocab_size = 2, 4, 8, 64
learning_rate, min_lr, warmup_iters, lr_decay_iters = 1e-2, 1e-3, 3, 12
grad_clip = 1.0
dtype = "float32"
keep_loop = os.environ.get("NANOGPT_KEEP_LOOP") == "1"

dist.init_process_group("gloo")
ddp_rank = int(os.environ["RANK"])
assert int(os.environ["LOCAL_RANK"]) == ddp_rank  # nanoGPT reads it for its device
os.makedirs(out_dir, exist_ok=True)  # every rank, before the Guard checks it
ctx = nullcontext()  # CPU: no autocast

# synthetic "train.bin" / "val.bin": the same tokens on every rank
tokens = torch.randint(0, vocab_size, (4096,), generator=torch.Generator().manual_seed(7))
data = {"train": tokens[:3072], "val": tokens[3072:]}


def get_batch(split: str) -> dict[str, torch.Tensor]:
    """nanoGPT's poor man's loader: random offsets from the global RNG."""
    ix = torch.randint(len(data[split]) - block_size, (batch_size,))
    x = torch.stack([data[split][i : i + block_size] for i in ix])
    y = torch.stack([data[split][i + 1 : i + 1 + block_size] for i in ix])
    return {"x": x, "y": y, "weight": torch.tensor(1.0)}


torch.manual_seed(0)  # the guard needs the same initial weights on every rank
model = DDP(
    TinyGPT(TinyGPTConfig(vocab=vocab_size, context=block_size, width=128, heads=2, layers=2))
)
raw_model = model.module
torch.manual_seed(1337 + ddp_rank)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95))
scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup_iters) / (lr_decay_iters - warmup_iters)))
    return min_lr + coeff * (learning_rate - min_lr)


class Best:
    """best_val_loss, in the trusted checkpoint instead of nanoGPT's ckpt.pt."""

    def __init__(self) -> None:
        self.val_loss = 1e9

    def state_dict(self) -> dict[str, float]:
        return {"val_loss": self.val_loss}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.val_loss = state["val_loss"]


best = Best()
sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: get_lr(it) / learning_rate)


def lm_loss(m: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    logits = m(batch["x"])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), batch["y"].reshape(-1))


def loss_fn(m: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    with ctx:
        loss = lm_loss(m, batch) * batch["weight"]  # weight: NaN for the bad sample
    return loss / gradient_accumulation_steps


@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    out = {}
    raw_model.eval()
    for split in ["train", "val"]:
        out[split] = sum(float(lm_loss(raw_model, get_batch(split))) for _ in range(eval_iters))
    raw_model.train()
    return out


config = sg.GuardConfig(
    replay_every=2, vote_every=2, max_grad_norm=None if keep_loop else grad_clip
)
guard = sg.Guard(
    model, optimizer, loss_fn, out_dir, scaler=scaler, config=config,
    stateful={"lr_scheduler": sched, "best": best},
)  # fmt: skip
iter_num = guard.resume()
losses_seen: dict[int, float] = {}
grad_norms: dict[int, torch.Tensor] = {}  # guard.last_grad_norm: no host sync in the loop
before: list[torch.Tensor] = []


def own_loop_step(micro: list[dict[str, Any]]) -> float:
    """nanoGPT's step as it is, with the guard's four calls around it."""
    losses = []
    for micro_step, batch in enumerate(micro):
        guard.capture(batch)
        model.require_backward_grad_sync = micro_step == len(micro) - 1
        loss = loss_fn(model, batch)
        scaler.scale(loss).backward()
        losses.append(loss)
    guard.check(losses)
    scaler.unscale_(optimizer)
    grad_norms[iter_num] = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    guard.after_update()
    return float(sum(loss.detach() for loss in losses))


def write_result(**extra: Any) -> None:
    os.makedirs(results_dir, exist_ok=True)
    weights = [p.detach().clone() for p in raw_model.parameters()]
    result = {
        "losses": losses_seen,
        "weights": weights,
        "lr": sched.get_last_lr(),
        "best": best.val_loss,
        "grad_norms": {it: float(n) for it, n in grad_norms.items()},
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, weights, strict=True)),
        **extra,
    }
    tmp = os.path.join(results_dir, f".rank-{ddp_rank}.pt")
    torch.save(result, tmp)
    os.replace(tmp, os.path.join(results_dir, f"rank-{ddp_rank}.pt"))


with sg.exit_on_alarm():
    try:
        while iter_num < max_iters:
            if iter_num % eval_interval == 0 and iter_num > 0:  # nanoGPT: eval, save, train
                losses = estimate_loss()
                improved = losses["val"] < best.val_loss
                best.val_loss = min(best.val_loss, losses["val"])
                guard.save_checkpoint(if_=improved or always_save_checkpoint)
            micro = [get_batch("train") for _ in range(gradient_accumulation_steps)]
            if nan_at == (iter_num, ddp_rank):
                micro[1]["weight"] = torch.tensor(float("nan"))
            before = [p.detach().clone() for p in raw_model.parameters()]  # for the test only
            if keep_loop:
                losses_seen[iter_num] = own_loop_step(micro)
            else:
                losses_seen[iter_num] = guard.step(sg.Microbatches(micro))
                if guard.last_grad_norm is not None:
                    grad_norms[iter_num] = guard.last_grad_norm
            sched.step()
            iter_num += 1
    except sg.SilentDataCorruption as exc:  # the test's record; exit_on_alarm then exits 86
        write_result(alarm=exc.alarm.verdict)
        raise
write_result(alarm=None)
dist.destroy_process_group()
