"""`python -m slurm_guard.kernels`: build the guard's C kernels into this node's cache, once.

The sbatch template runs it as one task per node before the training step: the ranks that start
next find the libraries built and load them (`kernels.build`: a lock per library, so a rank that
starts early waits for this build instead of repeating it). Prints each library, whether it was
built now or found built, and the cache; exits 1 when one could not be built (the guard then
uses its torch version: a job does not depend on this step).

`--check`: instead compile every shipped C source with -Wall -Wextra -Werror, native and
portable flags, with the constants the package passes, into a temporary directory (what CI
runs); exits 2 without a compiler, 1 when one fails.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from slurm_guard.fingerprint import nh as fingerprint_fast
from slurm_guard.kernels import abft_native, native, sketch


def check() -> int:
    sources = {
        fingerprint_fast.C_SOURCE: fingerprint_fast.kernel_defines(),
        sketch.C_SOURCE: sketch.kernel_defines(),
        abft_native.C_SOURCE: abft_native.kernel_defines(),
    }
    if native.compiler() is None:
        print("no C compiler found (set $CC or install cc, gcc or clang)", file=sys.stderr)
        return 2
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, defines in sources.items():
            for label, flags in (("native", native.NATIVE_FLAGS), ("portable", native.BASE_FLAGS)):
                out = Path(tmp) / f"{label}-{name}.so"
                proc = native.compile_source(name, defines, [*flags, *native.WARNING_FLAGS], out)
                status = "ok" if proc.returncode == 0 else "FAILED"
                print(f"{name} ({label}, -Wall -Wextra -Werror): {status}")
                if proc.returncode != 0:
                    print(proc.stderr, file=sys.stderr)
                    failed += 1
    return 1 if failed else 0


def prebuild() -> int:
    from slurm_guard.kernels.warm import KERNELS, warm_up

    report = warm_up(None)
    print(f"slurm-guard kernels: cache {native.cache_dir()}, compiler {native.compiler()}")
    for kernel in KERNELS:
        lib = kernel.library
        where = f" ({lib._name})" if lib is not None else ""
        print(f"  {kernel.source}: {report.native[kernel.source]}{where}")
    return 1 if "torch" in report.native.values() else 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--check"]):
        print("usage: python -m slurm_guard.kernels [--check]", file=sys.stderr)
        return 2
    return check() if args else prebuild()


if __name__ == "__main__":
    sys.exit(main())
