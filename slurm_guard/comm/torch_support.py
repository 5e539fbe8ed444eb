"""Which torch slurm-guard runs on, and the one error for a torch it cannot use.

The package leans on a handful of private or unstable torch APIs (docs/architecture.md, "Torch
versions", lists each with the versions tested). When one of them moves, the guard must stop
with a message that names the torch version and the API, never run on with a check quietly
switched off. Each such place calls `require_api` (or raises `unsupported_torch`) at the point
where it first needs the API, so the message names what the user was trying to do.

`TESTED_TORCH` is what CI runs (`.ci/run`: the main install and the newer-torch part); the floor
in pyproject.toml is the oldest of them (tests/test_torch_support.py holds the two together).
"""

from __future__ import annotations

import re

import torch

from slurm_guard.errors import GuardError

__all__ = [
    "TESTED_TORCH",
    "UnsupportedTorch",
    "UnsupportedVersion",
    "missing_methods",
    "require_api",
    "torch_version",
    "unsupported_release",
    "unsupported_torch",
]

TESTED_TORCH = ("2.13.0", "2.14.1")
"""Releases CI tests on every run (the README's and the user guide's tested range)."""


class UnsupportedVersion(GuardError):
    """An installed package lacks (or changed) an API the guard needs, named with its version."""


class UnsupportedTorch(UnsupportedVersion):
    """This torch lacks (or changed) an API the guard needs: upgrade torch or pick another path."""


def torch_version(text: str | None = None) -> tuple[int, int, int]:
    """`torch.__version__` as numbers ('2.14.1+cu130' -> (2, 14, 1)); (0, 0, 0) if unreadable."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", torch.__version__ if text is None else text)
    if match is None:
        return (0, 0, 0)
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def unsupported_torch(feature: str, api: str, *, found: str | None = None) -> UnsupportedTorch:
    """The error for `feature` on a torch without `api`, naming both versions and what to do."""
    version = torch.__version__ if found is None else found
    tested = " and ".join(TESTED_TORCH)
    return UnsupportedTorch(
        f"{feature} needs {api}, which torch {version} does not have (slurm-guard is tested on "
        f"torch {tested}); install one of those releases"
    )


def unsupported_release(
    package: str, version: str, tested: str, feature: str, api: str
) -> UnsupportedVersion:
    """The error for `feature` on a release of `package` (not torch) that moved `api`."""
    return UnsupportedVersion(
        f"{feature} needs {api}, which {package} {version} does not have or has changed "
        f"(slurm-guard is tested with {package} {tested}); install a tested release"
    )


def missing_methods(cls: type, names: tuple[str, ...]) -> list[str]:
    """The attributes of `names` that `cls` lacks (a torch where a private method moved)."""
    return [name for name in names if not callable(getattr(cls, name, None))]


def require_api(feature: str, cls: type, names: tuple[str, ...]) -> None:
    """Raise `UnsupportedTorch` if `cls` lacks any of `names`."""
    missing = missing_methods(cls, names)
    if missing:
        label = ", ".join(f"{cls.__name__}.{name}" for name in missing)
        raise unsupported_torch(feature, label)
