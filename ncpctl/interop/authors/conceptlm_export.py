"""``ncpctl export CKPT --format conceptlm``: a model back into the ConceptLM authors' layout
(conceptlm.py has the configs; conceptlm_io.py the weights both ways and the import)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from ncpctl.checkpoint import load_model
from ncpctl.errors import UserError
from ncpctl.interop.authors.conceptlm import LAYOUT, backbone_of, export_problems, their_config
from ncpctl.interop.authors.conceptlm_io import to_authors
from ncpctl.interop.hf_export import existing, new_dir, put_in_place, write_marker

TOLERANCE = 1e-5  # max |logit difference| of the reloaded export, relative to max(1, max |logit|)


def export(checkpoint: str | Path, out: str | Path, *, dtype: str = "fp32", verify: bool = True,
           max_shard_size: str | int = "5GB", log: Callable[[str], None] = lambda m: None,
           move_aside: bool = False) -> dict[str, Any]:
    """``ncpctl export --format conceptlm``: the model of ``checkpoint`` in their layout at ``out``:
    config.json, one model.safetensors (fp32: ``max_shard_size`` is not used) and the checkpoint's
    tokenizer.json when it has one. Written beside ``out`` and put in place whole, with the export
    marker (sizes and checksums) the other formats write: a directory export did not write, or an
    earlier export the user changed, is refused (``move_aside``: moved aside, never deleted). With
    ``verify`` it is reloaded through the importer and compared on a probe batch first."""
    from safetensors.torch import save_file

    if dtype != "fp32":
        raise UserError(f"--dtype {dtype}: the ConceptLM layout is written in fp32")
    out = Path(out)
    existing(out, move_aside)  # refuse before the (slow) load
    loaded = load_model(checkpoint)
    cfg = loaded.config
    problems = export_problems(cfg)
    if problems:
        raise UserError(*(f"{loaded.path}: cannot be written in the ConceptLM layout: {p}" for p in problems))
    sd = to_authors(loaded.model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_dir(out)
    try:
        (tmp / "config.json").write_text(json.dumps(their_config(cfg), indent=2, sort_keys=True) + "\n")
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok = Path(loaded.path) / "tokenizer.json"
        if tok.is_file():
            shutil.copyfile(tok, tmp / "tokenizer.json")
        arch = backbone_of(cfg).architecture
        log(f"wrote {len(sd)} tensors in the ConceptLM layout ({arch})")
        info = {"format": LAYOUT, "architecture": arch, "dtype": "fp32", "shards": 1,
                "parameters": int(sum(v.numel() for v in sd.values()))}
        if verify:
            info["verify"] = _verify(loaded, tmp, out)
        write_marker(tmp, "ncpctl export --format conceptlm", loaded.path)
        aside = put_in_place(tmp, out, move_aside)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {**info, "out": str(out), "files": sorted(p.name for p in out.iterdir()),
            **({"moved_aside": str(aside)} if aside is not None else {})}


def _verify(loaded, written: Path, out: Path) -> dict:
    """Reload the export ``written`` (not yet in place at ``out``) through the importer and compare its
    logits with ``loaded.model``'s on a probe batch (2 rows of 3 chunks and an unfinished one)."""
    import torch

    cfg = loaded.config
    T = min(cfg.max_seq_len, 3 * cfg.concept.k + cfg.concept.k // 2 + 1)
    x = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = loaded.model(x).logits[..., : cfg.vocab_size]
        got = load_model(written, with_tokenizer=False).model(x).logits[..., : cfg.vocab_size]
    diff, tol = float((got - want).abs().max()), TOLERANCE * max(float(want.abs().max()), 1.0)
    if not diff <= tol:  # the temporary directory goes; nothing reaches out
        raise UserError(f"{out}: the export gives other logits than {loaded.path} (max |diff| {diff:.3g}); "
                        "nothing kept")
    return {"max_abs_diff": diff, "tolerance": tol, "probe_tokens": list(x.shape)}
