"""`python -m slurm_guard.kernels`: compile every shipped C source with -Wall -Wextra -Werror,
native and portable flags, with the constants the package passes (what CI runs)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from slurm_guard.fingerprint import nh as fingerprint_fast
from slurm_guard.kernels import abft_native, native, sketch


def main() -> int:
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


if __name__ == "__main__":
    sys.exit(main())
