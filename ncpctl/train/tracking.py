"""Weights & Biases tracking (``train.wandb``), beside metrics.jsonl and TensorBoard.

Rank 0 only, as ``MetricsLog`` (which calls ``WandbRun.log`` with every record it writes):

* metrics: every numeric field of a metrics.jsonl record as ``SPLIT/KEY`` (``train/loss``,
  ``val/loss/a``, ``stability/attn/max_logit``: the TensorBoard names) at the record's ``step``;
  per-segment lists and strings stay in metrics.jsonl only, as for TensorBoard;
* config: the resolved recipe (``Recipe.to_dict``, what recipe.resolved.yaml holds);
* plots: with ``train.plots``, the PNGs as ``plots/NAME`` images at the last step (``finish``).

The run id lives in run.dir (``ncpctl.checkpoint.wandb_id_file``): a job resumed from the run's
own checkpoints passes it back with ``resume="allow"`` and W&B continues that run; a fresh run
(``train.resume: never``, or a run directory whose checkpoints were moved aside) gets a new id.
wandb is an optional extra (``pip install 'ncpctl[wandb]'``); ``require`` checks it before any
heavy work.
"""

from __future__ import annotations

import os
import secrets
import string
from pathlib import Path
from typing import Any, Callable

from ncpctl.checkpoint import wandb_id_file
from ncpctl.errors import UserError
from ncpctl.fsutil import atomic_write

INSTALL = "pip install 'ncpctl[wandb]'"


def require(recipe: Any) -> None:
    """``train.wandb`` without wandb installed: one line naming the install command (exit 2)."""
    if recipe.train.wandb is None:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError(f"{recipe.path}: train.wandb is set but wandb is not installed",
                        hint=f"{INSTALL} (or pip install wandb), or remove train.wandb") from None


class WandbRun:
    """One W&B run for a run directory; ``resumed``: this job continues the run's own checkpoint."""

    def __init__(self, recipe: Any, resumed: bool, info: Callable[[str], None]):
        import wandb

        spec, id_file = recipe.train.wandb, wandb_id_file(recipe.run_dir)
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else ""
        continued = bool(run_id)
        if not continued:  # a new lineage: a new W&B run, its id kept for the resumes to come
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's form
            recipe.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(id_file, run_id + "\n")
        try:
            self.run = wandb.init(
                project=spec.project, entity=spec.entity, name=spec.name or recipe.name, mode=spec.mode,
                id=run_id, resume="allow", config=recipe.to_dict(),
                dir=os.environ.get("WANDB_DIR") or str(recipe.run_dir),
                # console off: stdout stays ncpctl's (the --json summary); our own line says where it logs
                settings=wandb.Settings(console="off", silent=True))
        except wandb.errors.Error as e:
            raise UserError(f"train.wandb: W&B could not start the run ({str(e).splitlines()[0]})",
                            hint="`wandb login`, or train.wandb.mode: offline (then `wandb sync` later)") from None
        self.step = 0
        where = self.run.url or f"offline, {self.run.dir}"
        info(f"W&B run {run_id} ({'continued' if continued else 'new'}; {where})")

    def log(self, scalars: dict[str, float], step: int) -> None:
        """A record's numeric fields as ``SPLIT/KEY`` (``MetricsLog.write`` names them) at its step."""
        self.step = max(self.step, step)
        if scalars:
            self.run.log(scalars, step=step)

    def finish(self, images: list[Path]) -> None:
        """The plots as images at the last step, then the run's end (its files flushed)."""
        import wandb

        if images:
            self.run.log({f"plots/{p.stem}": wandb.Image(str(p)) for p in images}, step=self.step)
        self.run.finish()
