"""Reading checkpoint files without running code (issue 21).

A ``.pt`` file is a pickle, and unpickling may call any function the file names: a checkpoint
someone shared or a download could run ``os.system`` the moment it is opened. Every ``.pt``
file ncpctl reads therefore goes through :func:`load_pt`, ``torch.load(weights_only=True)``:
tensors, plain Python values (dict, list, tuple, str, numbers, ...) and the few classes named
in an explicit allow-list, nothing else. DeepSpeed 0.19 opens its own files with
``weights_only=False``; :func:`deepspeed_loads_safely` routes those loads through
:func:`load_pt` as well (its allow-list: what DeepSpeed pickles into a ZeRO 0-3 checkpoint).
Weights are safetensors (:func:`load_safetensors`), a format that holds no code.

A file that would need anything else, or that is truncated or damaged, is a ``UserError``:
one line naming the file and the problem (exit 2), never an internal error.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any, Iterator

from ncpctl.errors import UserError

# numpy's own picklers, which rng_rank*.pt files written before issue 21 hold (numpy's RNG state is
# an array); torch documents these as safe for weights_only. Allowed for those files only.
NUMPY_ARRAYS = ("numpy._core.multiarray:_reconstruct", "numpy:ndarray", "numpy:dtype", "numpy.dtypes:UInt32DType")

# What DeepSpeed pickles into its checkpoints besides tensors and plain values (found by saving
# and loading real debug checkpoints at ZeRO 0, 1, 2 and 3): the ZeRO stage enum, its loss
# scalers and the fragment addresses of the flat optimizer partitions. Each is a plain record
# (an Enum, a class whose state is numbers, a dataclass) whose unpickling runs no code of the file.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.zero.config:ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler:LossScaler",
    "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
    "deepspeed.utils.tensor_fragment:fragment_address",
)


def _resolve(names: tuple[str, ...]) -> list[Any]:
    """The objects an allow-list names (``module:attr``); names that do not import (numpy 1.x
    has no ``numpy._core``) are left out, which only refuses more."""
    out = []
    for name in names:
        module, _, attr = name.partition(":")
        try:
            out.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue
    return out


def _first_line(text: str, prefer: tuple[str, ...] = ()) -> str:
    """The line of a multi-line library message that says what was wrong."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    chosen = next((ln for word in prefer for ln in lines if word in ln), lines[0] if lines else "no data")
    return chosen.split(". ")[0].rstrip(".")  # the first sentence: torch appends paragraphs of advice


def _refusal(path: Path, e: BaseException) -> UserError:
    msg = str(e)
    if isinstance(e, pickle.UnpicklingError) and "GLOBAL" in msg:
        why = _first_line(msg, ("GLOBAL",))
        return UserError(f"{path}: refused to load: the file names Python code to run, not only tensors and "
                         f"plain values ({why}); ncpctl opens checkpoint files with torch.load(weights_only=True)",
                         hint="a checkpoint from a source you trust would not need this; do not load this file")
    if isinstance(e, EOFError) or (isinstance(e, OSError) and not isinstance(e, FileNotFoundError)):
        return UserError(f"{path}: truncated or unreadable ({type(e).__name__}: {_first_line(msg)})")
    if isinstance(e, FileNotFoundError):
        return UserError(f"{path}: missing (the checkpoint is incomplete)")
    why = _first_line(msg, ("central directory", "Unsupported operand", "failed reading", "WeightsUnpickler"))
    return UserError(f"{path}: damaged or truncated, not a readable PyTorch file ({why})")


def load_pt(path: str | os.PathLike[str], *, map_location: Any = "cpu", allow: tuple[str, ...] = (),
            **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)`` with the ``allow`` globals (``module:attr``) on
    top of torch's own safe set; a refused, truncated or damaged file raises a one-line
    ``UserError`` naming it."""
    import torch

    kwargs.pop("weights_only", None)  # never False, whatever a caller (DeepSpeed) asks
    path_ = Path(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else None
    try:
        with torch.serialization.safe_globals(_resolve(allow)), warnings.catch_warnings():
            # torch warns about pickle protocol 4 (DeepSpeed's legacy serialisation) on every file
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return (_torch_load or torch.load)(path, map_location=map_location, weights_only=True, **kwargs)
    except UserError:
        raise
    except (pickle.UnpicklingError, EOFError, RuntimeError, zipfile.BadZipFile, OSError, ValueError) as e:
        if path_ is None:
            raise
        raise _refusal(path_, e) from None


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``safetensors.torch.load_file`` with a damaged or truncated file (or header) turned into a
    one-line ``UserError`` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: missing (the checkpoint is incomplete)")
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise UserError(f"{path}: damaged or truncated safetensors file ({_first_line(str(e))})") from None
    except OSError as e:
        raise UserError(f"{path}: unreadable ({e.strerror or e})") from None


# ----------------------------------------------------------------------------- DeepSpeed

_torch_load: Any = None  # torch.load itself, while deepspeed_loads_safely has it replaced


@contextlib.contextmanager
def deepspeed_loads_safely() -> Iterator[None]:
    """Within: ``torch.load`` is :func:`load_pt` with DeepSpeed's allow-list, whatever
    ``weights_only`` the caller passes. DeepSpeed 0.19 calls ``torch.load(..., weights_only=False)``
    in its checkpoint engine, its ZeRO and universal-checkpoint loaders and ``DeepSpeedCheckpoint``
    (``ds_to_universal``); all of them look ``torch.load`` up on the ``torch`` module at call time,
    so this covers every file ``engine.load_checkpoint`` opens. Not re-entrant across threads:
    hold it around the load only (one thread loads)."""
    import torch

    global _torch_load
    real = _torch_load = torch.load

    def safe(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pickle_module", None)
        return load_pt(f, map_location=map_location, allow=DEEPSPEED_GLOBALS, **kwargs)

    torch.load = safe
    try:
        yield
    finally:
        torch.load, _torch_load = real, None
