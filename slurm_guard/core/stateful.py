"""The training state beyond the model and optimizer: LR schedulers, data loaders, the GradScaler.

A resume that restores the weights but not the scheduler trains on at the wrong learning rate,
and one that restores the weights but not the data loader's position feeds batches again or
skips them: either way not the run that was interrupted. `Guard(stateful={...})` takes any
object with `state_dict()` / `load_state_dict()` (torch's Stateful protocol); every checkpoint
saves each of them per rank (a loader's position differs per rank), with the GradScaler's state
when an enabled one is given, in `stateful-rank-<r>.pt` under the checkpoint's seal.

A resume loads that file with `torch.load(weights_only=True)`, which refuses anything but
tensors and plain Python data: saved as it is, a sampler's numpy RNG state would make every
checkpoint unloadable. So numpy arrays and scalars are saved as plain data (`_encode`) and
given back as numpy at the restore, and anything else such a load would refuse stops the save
naming its key, at the first save rather than at the resume that needs it.
"""

from __future__ import annotations

import copy
import io
import logging
import sys
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from slurm_guard.errors import GuardError

logger = logging.getLogger(__name__)

OBJECTS = "objects"
SCALER = "grad_scaler"
NUMPY = "__slurm_guard_numpy__"
"""Marks a numpy array or scalar saved as plain data: {NUMPY: dtype, "shape": [...],
"bytes": raw bytes}."""


@runtime_checkable
class Stateful(Protocol):
    """What `Guard(stateful=...)` accepts: torch's `torch.distributed.checkpoint.Stateful`."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def check_stateful(objects: Mapping[str, Any] | None) -> dict[str, Stateful]:
    """The objects by name; GuardError for a name or object the checkpoint could not carry."""
    if objects is None:
        return {}
    if not isinstance(objects, Mapping):
        raise GuardError(
            f"stateful= must map names to objects ({{'lr_scheduler': sched}}), "
            f"got {type(objects).__name__}"
        )
    out: dict[str, Stateful] = {}
    for name, obj in objects.items():
        if not isinstance(name, str) or not name:
            raise GuardError(f"stateful= names must be non-empty strings, got {name!r}")
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise GuardError(
                f"stateful[{name!r}] ({type(obj).__name__}) has no state_dict() and "
                "load_state_dict(): the guard could not save or restore it"
            )
        out[name] = obj
    return out


def setup_fields(
    objects: Mapping[str, Stateful], scaler: torch.amp.GradScaler | None
) -> dict[str, str]:
    """What must be the same on every rank: each rank saves and loads the same entries."""
    return {
        "stateful names": repr(sorted(objects)),
        "GradScaler enabled": repr(scaler is not None and scaler.is_enabled()),
    }


def expected(objects: Mapping[str, Stateful], scaler: torch.amp.GradScaler | None) -> bool:
    """Whether checkpoints carry a stateful file (and a resume requires one)."""
    return bool(objects) or (scaler is not None and scaler.is_enabled())


def collect(
    objects: Mapping[str, Stateful], scaler: torch.amp.GradScaler | None
) -> dict[str, Any] | None:
    """This rank's state to save, None when there is nothing (no file is written then)."""
    if not expected(objects, scaler):
        return None
    saved = {name: _encode(obj.state_dict()) for name, obj in objects.items()}
    for name, state in saved.items():
        problem = _unloadable(state, f"stateful[{name!r}].state_dict()")
        if problem is not None:
            raise GuardError(problem)
    return {
        OBJECTS: saved,
        SCALER: scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
    }


def _encode(value: Any) -> Any:
    """`value` with numpy arrays and scalars as plain data a weights_only load accepts.

    numpy is not a dependency (the CPU torch wheel comes without it): a state can hold numpy
    objects only where numpy was imported, so it is looked up, never imported, here.
    """
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype.hasobject:
            return value  # object arrays hold Python objects: `_unloadable` names them
        return {NUMPY: array.dtype.str, "shape": list(array.shape), "bytes": array.tobytes()}
    if isinstance(value, dict):
        return type(value)((k, _encode(v)) for k, v in value.items()) if _plain(value) else value
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_encode(v) for v in value)
    return value


def _plain(value: dict[Any, Any]) -> bool:
    return type(value) is dict or type(value).__name__ == "OrderedDict"


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if NUMPY in value and set(value) == {NUMPY, "shape", "bytes"}:
            np = _numpy()
            array = np.frombuffer(value["bytes"], dtype=np.dtype(value[NUMPY]))
            array = array.reshape(value["shape"]).copy()
            return array if array.shape else array[()]
        return type(value)((k, _decode(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_decode(v) for v in value)
    return value


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        raise GuardError(
            "the saved stateful state holds numpy arrays, and numpy is not installed here: "
            "pip install numpy"
        ) from None
    return numpy


def _loads_safely(value: Any) -> Exception | None:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception as exc:  # the unpickler's errors have no common type
        return exc
    return None


def _unloadable(state: Any, where: str) -> str | None:
    """Why a resume could not load `state` (weights_only), naming the innermost key; None if
    it can. Descends only into what fails, so a loadable state costs one round trip."""
    if _loads_safely(state) is None:
        return None
    items: list[tuple[Any, Any]] = []
    if isinstance(state, dict):
        items = list(state.items())
    elif isinstance(state, (list, tuple)):
        items = list(enumerate(state))
    for key, value in items:
        if _loads_safely(value) is not None:
            return _unloadable(value, f"{where}[{key!r}]")
    lines = str(_loads_safely(state)).strip().splitlines()
    reason = next((x for x in lines if "WeightsUnpickler" in x), lines[-1]).strip()[:200]
    return (
        f"{where} holds a {type(state).__module__}.{type(state).__qualname__}, which a resume "
        f"cannot load (torch.load(weights_only=True) refuses it: {reason}). Return tensors, "
        "numbers, strings, bytes, numpy arrays, and lists, tuples and dicts of them from "
        "state_dict() (a numpy RNG: its get_state() or bit_generator.state)"
    )


def missing(saved: Any, objects: Mapping[str, Stateful]) -> list[str]:
    """The objects given now that the saved state lacks; raises GuardError on a malformed one."""
    if not isinstance(saved, dict) or not isinstance(saved.get(OBJECTS), dict):
        raise GuardError("the stateful file is not one slurm-guard wrote")
    return [name for name in objects if name not in saved[OBJECTS]]


def scaler_restarts(saved: dict[str, Any] | None, scaler: torch.amp.GradScaler | None) -> bool:
    """An enabled GradScaler whose state the checkpoint lacks (saved while it was disabled,
    or before the guard saved it): it restarts from its initial scale and recalibrates within
    a few steps, so the resume goes on, but not bit-identically (see the user guide)."""
    enabled = scaler is not None and scaler.is_enabled()
    return enabled and (saved is None or saved.get(SCALER) is None)


def scaler_state(scaler: torch.amp.GradScaler | None) -> dict[str, Any] | None:
    """An enabled scaler's state now (before a resume: its initial one), else None."""
    if scaler is None or not scaler.is_enabled():
        return None
    return copy.deepcopy(scaler.state_dict())


def restore(
    saved: dict[str, Any], objects: Mapping[str, Stateful], scaler: torch.amp.GradScaler | None
) -> None:
    """Load every entry; `missing` must have found none."""
    for name, obj in objects.items():
        obj.load_state_dict(_decode(saved[OBJECTS][name]))
    if scaler is not None and scaler.is_enabled() and saved.get(SCALER) is not None:
        scaler.load_state_dict(saved[SCALER])
    extra = sorted(set(saved[OBJECTS]) - set(objects))
    if extra:
        logger.warning("the checkpoint's stateful %s not given now: not restored", extra)
