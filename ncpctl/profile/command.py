"""What ``ncpctl profile-kernels`` calls: ``run_profile(ProfileRequest, out)`` checks the request,
loads the recipe (data and tokenizer files are not needed: ``ncpctl.profile.load``) and runs
``ncpctl.profile.run.profile``; the tables (``render``) or the JSON result through ``out``.
torch is imported when it runs (``ncpctl --help`` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ncpctl.errors import UserError

if TYPE_CHECKING:
    from ncpctl.output import Output


@dataclass
class ProfileRequest:
    """``ncpctl profile-kernels``'s arguments as typed (``ncpctl/cli/profile_kernels.py`` documents each)."""

    recipe: str
    sets: list[str] = field(default_factory=list)
    only: str | None = None
    plot: bool = False
    repeats: int | None = None
    quick: bool = False
    device: str | None = None
    realised_ratio: float | None = None


def run_profile(req: ProfileRequest, out: Output) -> None:
    """Profile the recipe's model: the sections ``req.only`` names (default all but ops)."""
    from ncpctl.profile import DEFAULT_SECTIONS, SECTIONS

    only, device, realised_ratio = req.only, req.device, req.realised_ratio
    sections = list(DEFAULT_SECTIONS)
    if only:
        sections = [s.strip() for s in only.split(",") if s.strip()]
        bad = [s for s in sections if s not in SECTIONS]
        if bad or not sections:
            raise UserError(f"--only: unknown section(s) {', '.join(bad) or '(none)'}; choose from {', '.join(SECTIONS)}")

    from ncpctl.profile.load import load_for_profile

    r, notes = load_for_profile(req.recipe, req.sets)
    for note in notes:
        out.warn(note)

    law = r.model_config.law
    if realised_ratio is not None and not (law is not None and law.variable_length):
        raise UserError("--realised-ratio: the recipe's model has no dynamic segmentation",
                        hint="it applies to a segmentation whose segment lengths depend on the data, such as "
                             "model.concept.segmentation: dynamic (DLCM); fixed blocks have k")
    if realised_ratio is not None and not realised_ratio > 1:
        raise UserError(f"--realised-ratio: must be > 1 (tokens per concept), got {realised_ratio:g}")

    from ncpctl.profile.run import profile

    if device is not None:
        import torch

        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise UserError(f"--device: {device}: {e}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device: {device}: no CUDA device here", hint="use --device cpu")
    res = profile(r, sections, device=device, repeats=req.repeats, quick=req.quick, plot=req.plot,
                  realised_ratio=realised_ratio, log=lambda msg: out.info(f"[dim]{msg}[/]"))
    res["notes"] = notes

    def human(con) -> None:
        from ncpctl.profile.render import render

        render(con, res)

    out.result({"command": "profile-kernels", **res}, human)
