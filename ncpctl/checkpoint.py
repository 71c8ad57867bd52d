"""Self-describing model checkpoints for everything after training (style rule 7).

Every training checkpoint directory (``run.dir/checkpoints/step_NNNNNNN/``) holds, besides
DeepSpeed's own engine files, an inference view that needs no DeepSpeed to read:

    ncpctl.json        {"format": "ncpctl-checkpoint", "version": 1, "step", "tokens_seen",
                        "model_config": ModelConfig.to_dict(), "recipe": resolved recipe dict}
    model.safetensors  fp32 weights of NCPModel (full, consolidated; state_dict names)
    tokenizer.json     the tokenizer the data was made with (when known)

``eval``, ``generate`` and ``export`` need only this directory (or ``run.dir``, which
resolves to the newest complete checkpoint through ``checkpoints/latest``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncpctl.errors import UserError
from ncpctl.fsutil import atomic_write, atomic_write_with
from ncpctl.manifest import MANIFEST
from ncpctl.model.core.config import ConfigError, ModelConfig, from_checkpoint

FORMAT = "ncpctl-checkpoint"
VERSION = 1
META = "ncpctl.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
CHECKPOINTS = "checkpoints"  # run.dir/checkpoints/step_NNNNNNN/
ELASTIC = ".elastic-resume"  # run.dir/.elastic-resume/: a checkpoint re-partitioned for another world size, while it loads
WANDB_ID = "wandb-run-id"  # run.dir/wandb-run-id: the W&B run the run directory logs to (train.wandb)

# Whether reading a checkpoint checks its files against its manifest (``--no-verify`` turns it off
# for the command: the CLI sets it once, before any checkpoint is read).
_VERIFY = [True]


def set_verify(on: bool) -> None:
    _VERIFY[0] = bool(on)


def verifying() -> bool:
    return _VERIFY[0]


@dataclass
class LoadedModel:
    model: Any  # NCPModel, eval mode, on CPU
    config: ModelConfig
    tokenizer: Any | None  # tokenizers.Tokenizer
    meta: dict[str, Any]
    path: Path


def save_model_files(directory: Path, model: Any, *, step: int, tokens_seen: int, recipe: dict[str, Any] | None,
                     tokenizer_path: Path | None, extra: dict[str, Any] | None = None) -> None:
    """Write the inference view into ``directory`` (created). Call on one rank with the full
    (consolidated) state dict in ``model`` or pass a ``{name: tensor}`` dict as ``model``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = model if isinstance(model, dict) else model.state_dict()
    cfg = model.cfg if not isinstance(model, dict) else None
    # safetensors refuses shared storage; the tied lm_head is rebuilt from the config on load
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    if cfg is not None and cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    # each file atomically and fsynced (ncpctl.fsutil): a crash leaves the old file or the new one
    atomic_write_with(directory / WEIGHTS, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    if tokenizer_path is not None and Path(tokenizer_path).is_file():
        atomic_write_with(directory / TOKENIZER, lambda tmp: shutil.copyfile(tokenizer_path, tmp))
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "tokens_seen": tokens_seen,
        "model_config": (cfg.to_dict() if cfg is not None else (extra or {}).get("model_config")),
        "recipe": recipe,
        **{k: v for k, v in (extra or {}).items() if k != "model_config"},
    }
    # last: a directory with ncpctl.json is complete
    atomic_write(directory / META, json.dumps(meta, indent=2, default=str) + "\n")


def _warn(msg: str) -> None:
    sys.stderr.write(f"warning: {msg}\n")


def is_complete(directory: Path) -> bool:
    """``ncpctl.json`` is there and, when it says a manifest follows it, ``manifest.json`` too (a save
    killed between the two is unfinished). Checkpoints from before manifests need only ncpctl.json."""
    if not (directory / META).is_file():
        return False
    if (directory / MANIFEST).is_file():
        return True
    try:
        return "manifest" not in json.loads((directory / META).read_text())
    except (OSError, ValueError):
        return False


_PINS: dict[Path, int] = {}
_VERIFIED: set[Path] = set()


def pin(directory: Path) -> bool:
    """Hold a shared flock on ``directory`` for the rest of this process, so that ``keep_last``
    pruning (which needs an exclusive one) leaves it alone; True if it is still complete once pinned
    (pruning may have removed it between finding and pinning it)."""
    directory = Path(directory)
    if directory not in _PINS:
        try:
            fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except FileNotFoundError:
            return False
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a pruner holds it (then it is gone)
        _PINS[directory] = fd
    return is_complete(directory)


def unpin(directory: Path) -> None:
    fd = _PINS.pop(Path(directory), None)
    if fd is not None:
        os.close(fd)


def problem(directory: Path) -> str | None:
    """Why ``directory`` fails verification (its manifest), or None; checkpoints from before
    manifests, and every checkpoint under ``--no-verify``, pass unchecked."""
    if not verifying() or directory in _VERIFIED or not (directory / MANIFEST).exists() and is_complete(directory):
        return None
    from ncpctl import manifest

    found = manifest.verify(directory)
    if found is None:
        _VERIFIED.add(directory)
    return found


def _aside(directory: Path) -> Path:
    """Move a damaged checkpoint out of the way (never delete it): ``corrupt-step_N[.k]``."""
    target, k = directory.with_name(f"corrupt-{directory.name}"), 1
    while target.exists():
        target, k = directory.with_name(f"corrupt-{directory.name}.{k}"), k + 1
    os.replace(directory, target)
    return target


def newest_good(base: Path, *, warn: Any = _warn, move_aside: bool = False, pin_it: bool = True,
                tried: tuple[Path, ...] = ()) -> Path | None:
    """The newest complete checkpoint under ``base`` (a ``checkpoints`` directory) that verifies.
    Each one that fails is reported in one line and skipped (``move_aside``: moved to
    ``corrupt-step_N``, what the run that owns the directory does)."""
    for cand in sorted(base.glob("step_*"), reverse=True):
        if cand in tried or not cand.is_dir() or not is_complete(cand):
            continue
        if _take(cand, warn=warn, move_aside=move_aside, pin_it=pin_it):
            return cand  # None (pruned under us) and False (reported) both go on to the next
    return None


def _take(cand: Path, *, warn: Any, move_aside: bool, pin_it: bool) -> bool | None:
    """Pin (``pin_it``) and verify one complete checkpoint: True when it is good; None when pruning
    removed it before the pin; False when it fails verification (unpinned, reported in one line and,
    with ``move_aside``, moved to ``corrupt-step_N``)."""
    if pin_it and not pin(cand):
        return None
    found = problem(cand)
    if found is None:
        return True
    unpin(cand)
    where = f"; moved it to {_aside(cand).name}" if move_aside else ""
    warn(f"{cand}: {found}; skipped this checkpoint{where}")
    return False


def read_latest(latest: Path) -> str | None:
    """The tag a ``checkpoints/latest`` file holds (its first 256 bytes, stripped); None when there is
    none. Anything but a regular file there (a directory, a symbolic link, a FIFO: ncpctl never
    writes one, and reading it could block or reach anywhere) is one line naming it (issue 42)."""
    try:
        fd = os.open(latest, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symbolic link (O_NOFOLLOW); EISDIR cannot happen read-only
        fd = None
        if e.errno not in (errno.ELOOP, errno.EMLINK, errno.ENXIO):
            raise
    try:
        mode = os.fstat(fd).st_mode if fd is not None else os.lstat(latest).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode)
                    else "not a regular file")
            raise UserError(f"{latest}: is {kind}, not the one-line file ncpctl writes there",
                            hint="move it out of the checkpoints directory (ncpctl then uses the newest complete "
                                 "checkpoint, and training writes it anew)")
        return os.read(fd, 256).decode(errors="replace").strip()
    finally:
        if fd is not None:
            os.close(fd)


def check_latest(base: Path) -> None:
    """``base/latest`` is absent or a regular file (``read_latest``); before a run writes it."""
    read_latest(base / "latest")


def find_in(base: Path, *, warn: Any = _warn, move_aside: bool = False, pin_it: bool = True) -> Path | None:
    """The checkpoint a ``checkpoints`` directory stands for: the one ``latest`` names, if it is
    complete and verifies; else (a damaged or missing ``latest``, a damaged checkpoint) the newest
    good one, saying so. None when there is none."""
    latest = base / "latest"
    for _ in range(5):  # again only when pruning removed the named checkpoint under us
        tag = read_latest(latest)
        named = base / tag if tag and re.fullmatch(r"step_\d+", tag) else None
        if named is not None and is_complete(named):
            taken = _take(named, warn=warn, move_aside=move_aside, pin_it=pin_it)
            if taken is None:
                continue
            if taken:
                return named
            why = f"names {tag}, which failed verification"
        elif tag is None:
            why = "is missing"
        elif named is None:
            why = f"is damaged ({tag[:40]!r} is not a checkpoint tag)"
        else:
            why = f"names {tag}, which is not a complete checkpoint"
        good = newest_good(base, warn=warn, move_aside=move_aside, pin_it=pin_it, tried=(named,) if named else ())
        if good is not None:
            warn(f"{latest} {why}; using the newest complete verified checkpoint, {good.name}")
        elif tag is not None or any(base.glob("step_*")):
            warn(f"{latest} {why}, and no complete verified checkpoint is left in {base}")
        return good
    return None


def resolve(path: str | os.PathLike[str], *, warn: Any = _warn, pin_it: bool = True) -> Path:
    """A checkpoint directory from a checkpoint dir, a ``checkpoints/`` dir or a run dir (then the
    one ``latest`` names, or the newest good one: ``find_in``). The checkpoint is verified against
    its manifest (unless ``--no-verify``) and pinned against pruning for the rest of the process."""
    from ncpctl.interop.authors import steerling

    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such checkpoint or run directory")
    if steerling.detect(p) or _authors(p):  # a model directory in its authors' layout (issue 43): no manifest
        return p
    if (p / META).is_file():
        if pin_it:
            pin(p)
        found = problem(p)
        if found is not None:
            raise UserError(f"{p}: {found}", hint="use another checkpoint (or --no-verify to load it anyway)")
        return p
    for base in (p, p / CHECKPOINTS):
        if os.path.lexists(base / "latest") or any(base.glob("step_*")):
            good = find_in(base, warn=warn, pin_it=pin_it)
            if good is None:
                raise UserError(f"{base}: no complete verified checkpoint")
            return good
    raise UserError(f"{p}: not an ncpctl checkpoint (no {META}, no checkpoints/latest)",
                    hint="pass a checkpoint directory such as runs/debug/checkpoints/step_0000300 or a run directory")


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run directory a checkpoint directory belongs to (``RUN/checkpoints/step_N`` -> ``RUN``),
    or None for a checkpoint outside a run directory (copied elsewhere, an exported view).

    Where eval results, the export and the tokenized data of a checkpoint live by default.
    """
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else None


def elastic_dir(run_dir: Path) -> Path:
    """Where a resume on another number of ranks writes the checkpoint it converts (DeepSpeed's
    universal layout, ``ncpctl.train.elastic``); removed once every rank has loaded it."""
    return Path(run_dir) / ELASTIC


def wandb_id_file(run_dir: Path) -> Path:
    """The file in ``run_dir`` that holds the id of its W&B run (one line), so that a job resumed
    from the run's checkpoints continues the same W&B run (``ncpctl.train.tracking``)."""
    return Path(run_dir) / WANDB_ID


def _authors(directory: Path) -> bool:
    """``directory`` holds a model in the ConceptLM authors' layout (ncpctl/interop/authors/conceptlm.py),
    read through ``read_meta`` and ``read_weights`` (Steerling's has its own ``load``)."""
    from ncpctl.interop.authors import conceptlm

    return conceptlm.detect(directory)


def read_meta(directory: Path) -> dict[str, Any]:
    from ncpctl.interop.authors import steerling

    if steerling.detect(directory):
        return steerling.meta(directory)
    if _authors(directory):  # ConceptLM's: what ncpctl.json would say, the model config read from their config.json
        from ncpctl.interop.authors import conceptlm_io

        return conceptlm_io.meta(Path(directory))
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{directory / META}: unreadable checkpoint metadata ({e})") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{directory / META}: not an ncpctl checkpoint (format {meta.get('format')!r})")
    if meta.get("version", 0) > VERSION:
        raise UserError(f"{directory / META}: checkpoint format version {meta['version']} is newer than this "
                        f"ncpctl understands ({VERSION}); upgrade ncpctl")
    return meta


def read_weights(directory: Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The full fp32 state dict of checkpoint ``directory`` (tied lm_head restored)."""
    from ncpctl.safe_load import load_safetensors

    if _authors(directory):  # their weights, converted to ours
        from ncpctl.interop.authors import conceptlm_io

        return conceptlm_io.state(Path(directory))
    state = load_safetensors(directory / WEIGHTS)  # a missing or damaged file: one line naming it
    if (meta or read_meta(directory)).get("model_config", {}).get("tie_embeddings") and "embed.weight" in state:
        state.setdefault("lm_head.weight", state["embed.weight"])  # (without it: load_model names what is missing)
    return state


def load_model(path: str | os.PathLike[str], *, with_tokenizer: bool = True) -> LoadedModel:
    """NCPModel (fp32, CPU, eval mode) + tokenizer + metadata from a checkpoint or run dir, or from a
    model directory in the authors' layout (Steerling: the files' dtype, the weights mapped)."""
    import torch

    from ncpctl.interop.authors import steerling
    from ncpctl.model.core.model import NCPModel

    directory = resolve(path)
    if steerling.detect(directory):  # the authors' layout (ncpctl/interop/authors/steerling.py)
        return steerling.load(directory, with_tokenizer=with_tokenizer)
    meta = read_meta(directory)
    try:
        with from_checkpoint(directory):  # imports no strategy the user did not name (issue 21)
            cfg = ModelConfig.from_dict(meta["model_config"])
    except (ConfigError, TypeError, KeyError) as e:
        raise UserError(f"{directory / META}: invalid model_config ({e})") from None
    state = read_weights(directory, meta)
    with torch.device("meta"):
        model = NCPModel(cfg)
    weights = directory if _authors(directory) else directory / WEIGHTS
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # a tensor of the wrong shape: a damaged file or another model's
        raise UserError(f"{weights}: weights do not match the model config "
                        f"({str(e).strip().splitlines()[-1].strip()})") from None
    if missing or unexpected:
        raise UserError(f"{weights}: weights do not match the model config "
                        f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    for mod in model.modules():  # non-persistent buffers are not in the weights: still on meta
        for key, buf in mod._buffers.items():
            # an empty one (the bottleneck's lift tokens (n, 0) before a steering stage sets them) has no
            # value to lose; .to(device) would fail on it ("Cannot copy out of meta tensor")
            if buf is not None and buf.is_meta and buf.numel() == 0:
                mod._buffers[key] = torch.empty(buf.shape, dtype=buf.dtype)
    model.eval()
    tok = None
    if with_tokenizer and (directory / TOKENIZER).is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(directory / TOKENIZER))
    return LoadedModel(model=model, config=cfg, tokenizer=tok, meta=meta, path=directory)
