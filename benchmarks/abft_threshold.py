"""The smallest error a checked GEMM detects, per pass, dtype, shape and checksum block.

For `Linear(k, p)` on `n` rows of random data, the bound at each block and column of each of the
three products (forward, grad_x, grad_W; read with `Site.probe`, i.e. from the torch path, which
the C passes match) divided by the RMS of that product's elements: an error in one element larger
than this (plus the clean residual, a few percent of the bound) fails the check. Two kinds of
input: centred normal data, and the absolute values of normal data (a common positive offset,
like activations after GELU or ReLU), where unsigned block sums would add the offset up.
Dtypes: float32, float64, and float16 / bfloat16 GEMMs under CPU autocast (float32 parameters).

    python benchmarks/abft_threshold.py              # blocks 32 and 64
    python benchmarks/abft_threshold.py --block 128  # other blocks
    python benchmarks/abft_threshold.py --quick      # the two smaller shapes
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from _common import table, write_json
from torch import nn

from slurm_guard.abft import PASSES, attach
from slurm_guard.abft.site import HALF_BLOCK

SHAPES = ((64, 32, 128), (512, 256, 1024), (4096, 1024, 1024))
# name: (parameter and input dtype, autocast dtype or None)
DTYPES: dict[str, tuple[torch.dtype, torch.dtype | None]] = {
    "float32": (torch.float32, None),
    "float64": (torch.float64, None),
    "float16 (autocast)": (torch.float32, torch.float16),
    "bfloat16 (autocast)": (torch.float32, torch.bfloat16),
}


def thresholds(
    n: int, k: int, p: int, block: int, dtype: torch.dtype, cast: torch.dtype | None, offset: bool
) -> list[float]:
    """Median bound / RMS element for fwd, grad_x and grad_W of one random layer."""
    gen = torch.Generator().manual_seed(n + k + p)
    layer = nn.Linear(k, p).to(dtype)
    x = torch.randn(n, k, generator=gen, dtype=dtype)
    if offset:
        x = x.abs()
    x.requires_grad_(True)
    grad_y = torch.randn(n, p, generator=gen, dtype=dtype)
    handle = attach(layer, block=block)
    site = handle.sites[0]
    out = []
    for which in range(len(PASSES)):
        site.probe = {"which": which}
        with torch.autocast("cpu", dtype=cast or torch.bfloat16, enabled=cast is not None):
            y = layer(x)
        y.backward(grad_y)
        product = (y, x.grad, layer.weight.grad)[which]
        assert product is not None
        bound = site.probe["bound2"].sqrt()
        rms = product.detach().double().square().mean().sqrt()
        out.append(float(bound.median() / rms))
        x.grad = None
        layer.zero_grad(set_to_none=True)
        handle.collect()
    handle.detach()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, action="append", help="checksum block rows")
    parser.add_argument("--json", default=None, help="output path (default benchmarks/results/)")
    parser.add_argument("--quick", action="store_true", help="the two smaller shapes only")
    args = parser.parse_args()
    shapes = SHAPES[:2] if args.quick else SHAPES
    blocks = args.block or [32, 64]
    torch.set_num_threads(1)
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    for dtype_name, (dtype, cast) in DTYPES.items():
        for offset in (False, True):
            for n, k, p in shapes:
                for block in blocks:
                    values = thresholds(n, k, p, block, dtype, cast, offset)
                    data = "|normal|" if offset else "normal"
                    cells = [f"{v:.1e}" for v in values]
                    used = min(block, HALF_BLOCK) if cast is not None else block
                    shown = f"{block} (uses {used})" if used != block else str(block)
                    rows.append([dtype_name, data, f"{n} x {k} -> {p}", shown, *cells])
                    results.append(
                        {
                            "dtype": dtype_name,
                            "data": data,
                            "shape": [n, k, p],
                            "block": block,
                            "block_used": min(block, HALF_BLOCK) if cast is not None else block,
                            **dict(zip(PASSES, values, strict=True)),
                        }
                    )
    header = ["dtype", "input", "n x k -> p", "block", *(f"{p} bound/RMS" for p in PASSES)]
    print(table(header, rows))
    path = write_json("abft_threshold", {"blocks": blocks, "results": results}, args.json)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
