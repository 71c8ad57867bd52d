"""Weights to and from the ConceptLM authors' layout (conceptlm.py has the configs), their
directory opened as a loaded model, and the export back to it.

Their blocks are Hugging Face blocks under their own prefixes, so each converts with the backbone
family's HF mapping (``layer_from_hf`` / ``layer_to_hf``): ``encoder.i`` / ``decoder.j`` (under
``model.`` for Llama) are our token layers, ``hlm.transformer.c`` (Llama: ``model.hlm_layers.c``)
our concept layers. Their S used heads ``ctx_lm_head[i]`` (N, d) stack into our fused
``concept.heads`` (S N, d); each segment's ``vqs[i].frozen_codebook`` (N, d/S) and
``code_transform`` into ``concept.codebook.base`` (S, N, d/S) and the per-segment transform
(``SegmentLinear``: (S, out, in))."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from ncpctl.errors import UserError
from ncpctl.interop.authors.conceptlm import (BACKBONES, LAYOUT, _backbone_of, export_problems, model_config,
                                              read_config, their_config)


class _Reads(dict):
    """A state dict that remembers which keys were read (what is left over is refused)."""

    def __init__(self, *a: Any):
        super().__init__(*a)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)


def _stacks(cfg, bb) -> list[tuple[str, str, Any]]:
    """(their prefix, our prefix, the block config) of every block."""
    E, D, C = cfg.encoder_layers, cfg.decoder_layers, cfg.concept.concept_layers
    return ([(f"{bb.base}encoder.{i}.", f"encoder.{i}.", cfg) for i in range(E)]
            + [(f"{bb.base}decoder.{j}.", f"decoder.{j}.", cfg) for j in range(D)]
            + [(f"{bb.stack}{c}.", f"concept.layers.{c}.", cfg.concept_cfg) for c in range(C)])


def _transform_names(cfg) -> list[tuple[str, str, bool]]:
    """(their name under ``vqs.i.``, our name under ``concept.codebook.``, has a bias) per linear: their
    MLP is an ``nn.Sequential`` (0, 2), their GPT-2 transform one ``nn.Linear``."""
    layers = cfg.concept.transform_layers(cfg.segment_dim)
    theirs = ["code_transform."] if len(layers) == 1 else [f"code_transform.{2 * j}." for j in range(len(layers))]
    return [(t, f"transform.{2 * j}.", b) for j, (t, (_, _, b)) in enumerate(zip(theirs, layers))]


def from_authors(cfg, sd: dict) -> dict:
    """Our state dict (fp32) from theirs; a missing weight or one left over is a ``KeyError`` naming it."""
    import torch

    from ncpctl.model.registry import family

    bb, fam, sd = _backbone_of(cfg), family(cfg.backbone), _Reads(sd)
    out = {ours: sd[theirs] for ours, theirs in bb.top(cfg).items() if theirs in sd or not cfg.tie_embeddings}
    if "lm_head.weight" not in out:  # Llama with tie_word_embeddings may omit the tied head
        out["lm_head.weight"] = out["embed.weight"]
    for theirs, ours, bcfg in _stacks(cfg, bb):
        out.update(fam.layer_from_hf(bcfg, sd, theirs, ours))
    S = cfg.n_segments
    for p in ("weight", "bias"):
        out[f"concept.heads.{p}"] = torch.cat([sd[f"{bb.heads}{i}.{p}"] for i in range(S)])
        if bb.head_norm is not None:
            out[f"concept.norm.{p}"] = sd[f"{bb.head_norm}{p}"]
    vq = f"{bb.base}vqs."
    out["concept.codebook.base"] = torch.stack([sd[f"{vq}{i}.frozen_codebook"] for i in range(S)])
    for theirs, ours, bias in _transform_names(cfg):
        for p in ("weight", "bias") if bias else ("weight",):
            out[f"concept.codebook.{ours}{p}"] = torch.stack([sd[f"{vq}{i}.{theirs}{p}"] for i in range(S)])
    unused = f"{bb.heads}"  # heads from S up (H / vq_patch_ratio) are saved but never run
    left = [k for k in set(sd) - sd.read if not (k.startswith(unused) and int(k[len(unused):].split(".")[0]) >= S)
            and ".cached_" not in f".{k}"]  # Llama's cached_* buffers: activations a forward left behind
    if left:
        raise KeyError(f"weights ncpctl does not read: {', '.join(sorted(left)[:4])}{' ...' if len(left) > 4 else ''}")
    return {k: v.float().contiguous() for k, v in out.items()}


def to_authors(model) -> dict:
    """Their state dict of ``model`` (``export_problems`` empty): the unused heads zero, no cached_*."""
    import torch

    from ncpctl.model.registry import family

    cfg = model.cfg
    bb, fam, sd = _backbone_of(cfg), family(cfg.backbone), model.state_dict()
    out = {theirs: sd[ours] for ours, theirs in bb.top(cfg).items() if ours in sd}
    for theirs, ours, bcfg in _stacks(cfg, bb):
        out.update(fam.layer_to_hf(bcfg, sd, ours, theirs))
    S, N, H = cfg.n_segments, cfg.concept.codes, cfg.n_heads
    for p in ("weight", "bias"):
        parts = list(sd[f"concept.heads.{p}"].split(N))
        parts += [torch.zeros_like(parts[0])] * (H - S)  # their module holds H heads
        out.update({f"{bb.heads}{i}.{p}": t for i, t in enumerate(parts)})
        if bb.head_norm is not None:
            out[f"{bb.head_norm}{p}"] = sd[f"concept.norm.{p}"]
    vq = f"{bb.base}vqs."
    for i in range(S):
        out[f"{vq}{i}.frozen_codebook"] = sd["concept.codebook.base"][i]
        for theirs, ours, bias in _transform_names(cfg):
            for p in ("weight", "bias") if bias else ("weight",):
                out[f"{vq}{i}.{theirs}{p}"] = sd[f"concept.codebook.{ours}{p}"][i]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


# ---- their directory as a checkpoint ---------------------------------------------------------

def meta(directory: Path) -> dict:
    """What ``ncpctl.json`` would say of ``directory`` (checkpoint.read_meta's answer for it)."""
    from ncpctl.checkpoint import FORMAT, VERSION

    j = read_config(directory)
    return {"format": FORMAT, "version": VERSION, "step": 0, "tokens_seen": 0, "recipe": None,
            "model_config": model_config(directory).to_dict(),
            "authors": {"layout": LAYOUT, "backbone": BACKBONES[j["model_type"]].name, "config": j}}


def state(directory: Path) -> dict:
    """Our fp32 state dict of their ``directory`` (checkpoint.read_weights's answer for it)."""
    from ncpctl.interop.hf_import import read_hf_state_dict

    cfg = model_config(directory)
    try:
        return from_authors(cfg, read_hf_state_dict(directory))
    except KeyError as e:
        raise UserError(f"{directory}: the weights do not fit their config.json ({e.args[0]})") from None


# ---- the export back to their layout ---------------------------------------------------------

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

    from ncpctl.checkpoint import load_model
    from ncpctl.interop.hf_export import _new_dir, _put_in_place, existing, write_marker

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
    tmp = _new_dir(out)
    try:
        (tmp / "config.json").write_text(json.dumps(their_config(cfg), indent=2, sort_keys=True) + "\n")
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok = Path(loaded.path) / "tokenizer.json"
        if tok.is_file():
            shutil.copyfile(tok, tmp / "tokenizer.json")
        arch = _backbone_of(cfg).architecture
        log(f"wrote {len(sd)} tensors in the ConceptLM layout ({arch})")
        info = {"format": LAYOUT, "architecture": arch, "dtype": "fp32", "shards": 1,
                "parameters": int(sum(v.numel() for v in sd.values()))}
        if verify:
            info["verify"] = _verify(loaded, tmp, out)
        write_marker(tmp, "ncpctl export --format conceptlm", loaded.path)
        aside = _put_in_place(tmp, out, move_aside)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {**info, "out": str(out), "files": sorted(p.name for p in out.iterdir()),
            **({"moved_aside": str(aside)} if aside is not None else {})}


def _verify(loaded, written: Path, out: Path) -> dict:
    """Reload the export ``written`` (not yet in place at ``out``) through the importer and compare its
    logits with ``loaded.model``'s on a probe batch (2 rows of 3 chunks and an unfinished one)."""
    import torch

    from ncpctl.checkpoint import load_model

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
