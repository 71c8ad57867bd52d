"""``export``: an ncpctl checkpoint -> a complete Hugging Face model directory.

* Base models (no concept path) become native ``GPTNeoXForCausalLM`` / ``LlamaForCausalLM``
  (``Qwen3ForCausalLM`` with per-head QK-norm; ``Olmo2ForCausalLM``, or ``Olmo3ForCausalLM``
  with a sliding window, for post-norm blocks) / ``GPT2LMHeadModel`` through ``ncpctl.model.families.hf``.
* ConceptLM models (and any model with Steerling's concept bottleneck, whose heads and concept
  embeddings travel with it: ``model.core`` attributes exactly) become ``NCPForCausalLM``: the HF adapter (``configuration_ncp.py``,
  ``modeling_ncp.py`` from ``ncpctl/interop/remote/``) and the modules of ``ncpctl/model/``
  it reaches (``core/model.py``, ``core/layers.py``, ..., found by following their imports and
  the registry's import paths: the built-in designs' records) are copied into the directory,
  flattened into one folder (``core/layers.py`` -> ``core_layers.py``, ``from
  ncpctl.model.core.layers import`` -> ``from .core_layers import``: only import lines change),
  and ``config.json`` maps them with ``auto_map``: the modeling code exists once, and
  ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` needs no ncpctl
  (transformers copies only the files a module imports with ``from .x import y``, so the adapter
  also imports each module the registry names by path; the model package imports nothing
  outside itself). A model whose
  segmentation, coupling or residual is not built in cannot be exported this way.

Files: ``config.json``, ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` +
``model.safetensors.index.json`` above ``max_shard_size``), ``generation_config.json``,
``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``
(``PreTrainedTokenizerFast``).

The directory is written next to ``out`` and put into place only after it verified:
it is reloaded with transformers and its logits on a probe batch are compared with the
source model's (for ``bf16`` against the source with bf16-rounded weights, which isolates
conversion errors from rounding; the difference to the fp32 source is reported too); the
tokenizer must encode a probe text to the same ids. Above the tolerance nothing is kept.

An export writes only what it owns. Every export carries ``MARKER`` (``.ncpctl-export.json``: the
names of the files it wrote, and each one's size and xxh3-128 checksum as ``ncpctl.manifest``
records a checkpoint's). An existing ``out`` is replaced only if it is an earlier export whose
every entry is a file the marker lists, with the size and checksum it lists (a file the user
added there, or changed, e.g. with ``model.save_pretrained(out)``, is never deleted), or filled in
place if it is an empty directory (whose mode and owner stay); anything else, a Hugging Face
model directory with its own ``config.json`` included, is refused. ``move_aside``: an earlier
export the user added to or changed is renamed to ``OUT.prev-TIME`` (kept whole) instead. Exports
written before the marker existed are refused too (with a hint): a native export holds exactly
what a downloaded HF model holds, so nothing could tell them apart safely; so are exports whose
marker has no checksums (nothing tells whether their files changed). The new directory gets the
process's umask mode (an earlier export's mode when it replaces one), never mkdtemp's 0700.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ncpctl import __version__
from ncpctl.errors import UserError

REMOTE = Path(__file__).parent / "remote"
MODEL_PACKAGE = Path(__file__).parents[1] / "model"
_RELATIVE = re.compile(r"^\s*from\s+\.(\w+)\s+import", re.MULTILINE)
# the model package's imports in shipped code, made flat by the export: (indent, module)
_MODEL_IMPORT = re.compile(r"^([ \t]*)from[ \t]+(ncpctl\.model(?:\.\w+)+)[ \t]+import[ \t]+", re.MULTILINE)
# the registry's built-in import paths (".core.segment:FixedBlocks"), resolved in the exported folder
_TARGET = re.compile(r"""(["'])\.((?:\w+\.)*\w+):(\w+)""")
# any other import of ncpctl (or of a package-relative path) would not resolve in the export
_OTHER_IMPORT = re.compile(r"^[ \t]*(from[ \t]+ncpctl\b.*|import[ \t]+ncpctl\b.*|from[ \t]+\.\w*\.\w.*)$", re.MULTILINE)
_ADAPTER_NAMES = {"modeling_ncp.py", "configuration_ncp.py"}
PROBE_TEXT = "def f(x):\n    return x + 1  # probe: ünïcode, tabs\tand  spaces\n"
TOLERANCE = 1e-4  # max |logit difference| allowed, relative to max(1, max |logit|)
# in every export: {"written_by", "ncpctl_version", "checkpoint", "files": [NAME], "algorithm": "xxh3_128",
# "manifest": {NAME: {"size", "xxh3_128"}}}
MARKER = ".ncpctl-export.json"
_REFUSE = "choose a new or empty --out directory, or move that directory away yourself"


def export(checkpoint: str | Path, out: str | Path, *, dtype: str = "fp32", verify: bool = True,
           max_shard_size: str | int = "5GB", log: Callable[[str], None] = lambda m: None,
           move_aside: bool = False) -> dict[str, Any]:
    import torch

    from ncpctl.checkpoint import load_model

    if dtype not in ("fp32", "bf16"):
        raise UserError(f"--dtype: {dtype!r} is not one of fp32, bf16")
    out = Path(out)
    existing(out, move_aside)  # refuse before the (slow) load
    loaded = load_model(checkpoint)
    why = loaded.model.objective.refusal("export")
    if why:
        raise UserError(f"{loaded.path}: {why}")
    if loaded.tokenizer is None:
        raise UserError(f"{loaded.path}: no tokenizer.json in the checkpoint; an export needs one")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_dir(out)
    try:
        info = _write(loaded, tmp, getattr(torch, "bfloat16" if dtype == "bf16" else "float32"), max_shard_size)
        info["dtype"] = dtype
        if verify:
            log("verifying: reloading the export with transformers and comparing logits")
            info["verify"] = _verify(loaded, tmp, dtype)
        write_marker(tmp, "ncpctl export", loaded.path)
        aside = _put_in_place(tmp, out, move_aside)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if aside is not None:
        info["moved_aside"] = str(aside)
    info["out"] = str(out)
    info["files"] = sorted(p.name for p in out.iterdir())
    return info


def write_marker(tmp: Path, written_by: str, checkpoint: Path) -> None:
    """``MARKER`` in the finished export ``tmp``: every file's name, size and xxh3-128 checksum."""
    from ncpctl import manifest

    files = sorted(p.name for p in tmp.iterdir())
    (tmp / MARKER).write_text(json.dumps({"written_by": written_by, "ncpctl_version": __version__,
                                          "checkpoint": str(checkpoint), "files": files,
                                          "algorithm": manifest.ALGORITHM,
                                          "manifest": manifest.describe(tmp, files)}, indent=2) + "\n")


def existing(out: Path, move_aside: bool = False) -> str:
    """What is at ``out``, and so how the export goes there: "new" (nothing: the finished
    directory is renamed into place), "empty" (an empty directory: filled in place, its mode and
    owner kept), "ours" (an earlier export holding only the files its marker lists, as it wrote
    them: replaced whole) or, with ``move_aside``, "aside" (an earlier export the user added to or
    changed: renamed, kept whole). Anything else raises: export never deletes what it did not write."""
    if not os.path.lexists(out):
        return "new"
    if out.is_symlink() or not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory that ncpctl export wrote; refusing to replace it",
                        hint=_REFUSE)
    entries = list(out.iterdir())
    if not entries:
        return "empty"
    try:
        marker = json.loads((out / MARKER).read_text())
        files = marker["files"]
        if not (isinstance(files, list) and all(isinstance(f, str) for f in files)):
            raise TypeError(files)
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{out}: not a directory that ncpctl export wrote (no valid {MARKER}); refusing to replace "
                        "it", hint=_REFUSE + " (exports written before ncpctl marked them carry no marker)") from None
    foreign = sorted(p.name for p in entries if p.name != MARKER and (p.name not in files or _is_real_dir(p)))
    problem = (f"holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, which the earlier export did "
               "not write") if foreign else _changed(out, marker, [p for p in entries if p.name != MARKER])
    if problem is None:
        return "ours"
    if move_aside:
        return "aside"
    raise UserError(f"{out}: {problem}; refusing to replace it",
                    hint="move those out of the directory, choose another --out, or pass --move-aside to have the "
                    "earlier export moved to OUT.prev-TIME (kept whole)")


def _changed(out: Path, marker: dict[str, Any], entries: list[Path]) -> str | None:
    """What in the earlier export ``out`` differs from what its marker says export wrote (one
    phrase naming the files), or None: every entry a regular file of the recorded size and
    xxh3-128 checksum."""
    from ncpctl import manifest

    recorded = marker.get("manifest")
    if marker.get("algorithm") != manifest.ALGORITHM or not isinstance(recorded, dict):
        return f"its {MARKER} records no checksums (an older ncpctl wrote it): its files may have changed since"
    changed = []
    for p in sorted(entries):
        entry = recorded.get(p.name)
        if (not isinstance(entry, dict) or p.is_symlink() or not p.is_file() or p.stat().st_size != entry.get("size")
                or manifest.file_hash(p) != entry.get(manifest.ALGORITHM)):
            changed.append(p.name)
    if not changed:
        return None
    return (f"{', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''} changed since ncpctl export wrote "
            f"{'it' if len(changed) == 1 else 'them'}")


def _is_real_dir(p: Path) -> bool:
    return p.is_dir() and not p.is_symlink()


def _new_dir(out: Path) -> Path:
    """A fresh hidden directory next to ``out`` (``.NAME.tmp-PID-RANDOM``), created with the
    umask's mode like any directory the user makes (mkdtemp's 0700 would carry over to ``out``)."""
    while True:
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def _put_in_place(tmp: Path, out: Path, move_aside: bool = False) -> Path | None:
    """Put the finished export ``tmp`` at ``out`` (checked again: the export took a while). Its
    files are synced first; an earlier export is moved aside (not deleted) until the new one is in
    place; an empty directory is filled in place: the marker first (so that a crash leaves a
    directory the next export may replace) and ``config.json`` last (nothing loads until then).
    Returns where an earlier export the user changed was moved (``move_aside``), else None."""
    from ncpctl.fsutil import fsync_dir, fsync_tree

    fsync_tree(tmp)
    how = existing(out, move_aside)
    if how == "empty":
        names = sorted((p.name for p in tmp.iterdir()), key=lambda n: (n != MARKER, n == "config.json", n))
        for name in names:
            shutil.move(tmp / name, out / name)
        fsync_dir(out)
        tmp.rmdir()
        return None
    old = None
    if how == "ours":
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
    elif how == "aside":
        old = _free_name(out.with_name(f"{out.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}"))
    if old is not None:
        os.chmod(tmp, stat.S_IMODE(out.stat().st_mode))  # the earlier export's mode, if the user changed it
        os.replace(out, old)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    if how == "ours":
        shutil.rmtree(old, ignore_errors=True)  # only files export wrote, as it wrote them
    return old if how == "aside" else None


def _free_name(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``, ...: the first name nothing holds (never replace a move)."""
    n, cand = 1, path
    while os.path.lexists(cand):
        n += 1
        cand = path.with_name(f"{path.name}-{n}")
    return cand


def _eod(loaded) -> tuple[str, int]:
    from ncpctl.inference import eod_token

    token, tid = eod_token(loaded)
    if tid is None:
        raise UserError(f"{loaded.path}: the tokenizer has no end-of-document token {token!r}")
    return token, tid


def _write(loaded, d: Path, torch_dtype, max_shard_size) -> dict[str, Any]:
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    cfg, model = loaded.config, loaded.model
    eod_token, eod = _eod(loaded)
    dtype_name = str(torch_dtype).removeprefix("torch.")
    # the concept path, Steerling's bottleneck or another objective than next-token prediction: no HF
    # architecture holds them, so the export carries ncpctl's own modeling code (remote code); the
    # bottleneck's heads and embeddings travel with it
    if _remote(model):
        arch = "NCPForCausalLM"
        config = {
            "architectures": [arch], "model_type": "ncp",
            "auto_map": {"AutoConfig": "configuration_ncp.NCPConfig",
                         "AutoModelForCausalLM": "modeling_ncp.NCPForCausalLM"},
            "ncp": {**cfg.to_dict(), "mtp_depth": None}, "derived": _derived(cfg),  # the main head only
            "vocab_size": cfg.padded_vocab_size, "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads,
            "num_hidden_layers": cfg.n_token_layers, "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": eod, "eos_token_id": eod, "dtype": dtype_name,
        }
        _check_builtin(cfg)  # first: a strategy that cannot travel is the root of any later refusal
        mask = _mask_token(loaded)
        if mask is not None:  # where transformers' diffusion LMs look for it (a CDLM's [MASK])
            config["mask_token_id"] = mask[1]
        (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for shipped in remote_files():
            (d / shipped.name).write_text(shipped.text)
        state = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}  # MTP: training only
        if cfg.tie_embeddings:
            state.pop("lm_head.weight", None)
    else:
        from ncpctl.model.core.config import ConfigError
        from ncpctl.model.families.hf import hf_architecture, hf_config, to_hf_state_dict

        try:
            hf = hf_config(cfg)
        except ConfigError as e:
            raise UserError(*(f"model.{k}: {m} (no HF model holds this)" for k, m in e.problems)) from None
        arch = hf_architecture(cfg, hf)
        hf.architectures = [arch]
        hf.bos_token_id = hf.eos_token_id = eod
        hf.dtype = dtype_name
        hf.save_pretrained(d)
        state = to_hf_state_dict(model)
        if cfg.tie_embeddings:
            state.pop("lm_head.weight", None)
    shards = _save_weights(state, d, torch_dtype, max_shard_size)
    GenerationConfig(bos_token_id=eod, eos_token_id=eod, pad_token_id=eod, do_sample=False,
                     max_new_tokens=min(256, cfg.max_seq_len)).save_pretrained(d)
    mask = _mask_token(loaded)
    if mask is not None and mask[1] not in loaded.tokenizer.get_added_tokens_decoder():
        mask = None  # an ordinary BPE piece (a model built without a recipe): a special mask_token would split text
    tok = PreTrainedTokenizerFast(tokenizer_object=loaded.tokenizer, bos_token=eod_token, eos_token=eod_token,
                                  unk_token=eod_token, pad_token=eod_token, model_max_length=cfg.max_seq_len,
                                  **({"mask_token": mask[0]} if mask is not None else {}))
    tok.save_pretrained(d)
    return {"architecture": arch, "remote_code": arch == "NCPForCausalLM", "shards": shards,
            "mask_token": None if mask is None else mask[0],
            "parameters": sum(t.numel() for t in state.values())}


def _mask_token(loaded) -> tuple[str, int] | None:
    """The [MASK] token (text, id) of an objective that has one (a CDLM's), as its tokenizer holds it."""
    mask_id = getattr(loaded.model.objective, "mask_id", None)
    if mask_id is None:
        return None
    text = loaded.tokenizer.id_to_token(mask_id) if loaded.tokenizer is not None else None
    if text is None:
        raise UserError(f"{loaded.path}: the tokenizer has no token with the [MASK] id {mask_id}")
    return text, mask_id


def _remote(model) -> bool:
    """Whether the export carries ncpctl's modeling code (no HF architecture holds the model): the
    concept path, the bottleneck, or an objective whose attention is not causal (a Causal Diffusion
    LM's block-causal attention and block sampling are in no HF causal LM)."""
    cfg = model.cfg
    return cfg.concept.enabled or cfg.bottleneck.enabled or not model.objective.causal


@dataclass(frozen=True)
class Shipped:
    """One file of an exported NCP directory's code: its flat ``name`` (``core_layers.py``), the
    ``source`` it is made from and its ``text`` (the source's, with only its imports made flat)."""

    name: str
    source: Path
    text: str


def flat_name(module: str) -> str:
    """The exported file of model module ``module``: ``ncpctl.model.core.layers`` -> ``core_layers``
    (transformers copies only the files of flat relative imports, ``from .x import y``)."""
    rel = module.removeprefix("ncpctl.model").lstrip(".")
    if not rel or module.split(".")[:2] != ["ncpctl", "model"]:
        raise ValueError(f"{module}: not a module of the model package (the export ships only those)")
    return rel.replace(".", "_")


def _source(module: str) -> Path:
    path = MODEL_PACKAGE.joinpath(*module.removeprefix("ncpctl.model.").split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _flatten(text: str, where: str, named: list[tuple[str, str]] | None = None) -> tuple[str, list[str]]:
    """``text`` with its model-package imports (``from ncpctl.model.a.b import``) and the registry's
    built-in import paths (``".a.b:Class"``) made flat, and the model modules they name (the import
    paths' (module, name) also appended to ``named``)."""
    found: list[str] = []

    def imp(m: re.Match) -> str:
        found.append(m.group(2))
        return f"{m.group(1)}from .{flat_name(m.group(2))} import "

    def target(m: re.Match) -> str:
        module = f"ncpctl.model.{m.group(2)}"
        if not _source(module).is_file():
            return m.group(0)
        found.append(module)
        if named is not None:
            named.append((module, m.group(3)))
        return f"{m.group(1)}.{flat_name(module)}:{m.group(3)}"

    text = _MODEL_IMPORT.sub(imp, text)
    text = _TARGET.sub(target, text)
    bad = _OTHER_IMPORT.search(text)
    if bad:
        raise ValueError(f"{where}: {bad.group(0).strip()!r}: exported code imports the model package only, "
                         "as `from ncpctl.model.x.y import name`")
    return text, found


def remote_files() -> list[Shipped]:
    """The files of an exported NCP directory's code: the HF adapter (``ncpctl/interop/remote/``)
    and every module of the model package it reaches through its imports and the registry's
    built-in import paths (the built-in designs and backbone families), flattened into one folder:
    transformers' remote-code loader follows only ``from .x import y``."""
    todo = [("remote", p.stem) for p in sorted(REMOTE.glob("*_ncp.py"))]
    found: dict[str, Shipped] = {}
    named: list[tuple[str, str]] = []  # (module, name) of the import paths the shipped code holds
    while todo:
        kind, module = todo.pop()
        name = module if kind == "remote" else flat_name(module)
        if name in found:
            continue
        source = REMOTE / f"{name}.py" if kind == "remote" else _source(module)
        text, reached = _flatten(source.read_text(), str(source), named)
        if kind == "remote":  # the adapter's own files import each other relatively already
            reached += [m for m in _RELATIVE.findall(source.read_text())]
        found[name] = Shipped(f"{name}.py", source, text)
        todo += [("remote", m) if (REMOTE / f"{m}.py").is_file() else ("model", m) for m in reached]
    # transformers copies only what ``from .x import`` lines reach: the adapter imports the modules
    # that the registry names by import path (the built-in strategies, the designs' records)
    adapter = found["modeling_ncp"]
    lines = [f"from .{flat_name(m)} import {n} as _named_{i}  # noqa: E402,F401"
             for i, (m, n) in enumerate(sorted(set(named)))]
    found["modeling_ncp"] = Shipped(adapter.name, adapter.source, adapter.text.rstrip() + "\n\n\n# the modules "
                                    "the registry names by import path, so that transformers copies them\n"
                                    + "\n".join(lines) + "\n")
    clash = {s.name for s in found.values() if s.name in _ADAPTER_NAMES and s.source.parent != REMOTE}
    if clash:
        raise ValueError(f"model modules flatten onto the adapter's file names: {sorted(clash)}")
    return sorted(found.values(), key=lambda s: s.name)


def _check_builtin(cfg) -> None:
    """Only built-in strategies travel with the export (a registered or imported class's code
    lives outside the model package)."""
    from ncpctl.model.core.config import STRATEGIES

    c = cfg.concept
    for key, kind, name in (("model.backbone", "backbone", cfg.backbone), ("model.residual", "residual", cfg.residual),
                            ("model.objective", "objective", cfg.objective),
                            ("model.concept.segmentation", "segmentation", c.segmentation),
                            ("model.concept.coupling", "coupling", c.coupling)):
        target = STRATEGIES[kind].get(name)
        if not (isinstance(target, str) and target.startswith(".")):
            raise UserError(f"{key}: {name!r} is not built into ncpctl, so the exported code cannot include it",
                            hint="export supports the built-in backbone, objective, segmentation, coupling and residual")


def _derived(cfg) -> dict[str, Any]:
    names = ("padded_vocab_size", "head_dim", "rotary_dim", "n_token_layers", "encoder_layers", "decoder_layers",
             "n_segments", "segment_dim")
    return {n: getattr(cfg, n) for n in names}


def _save_weights(state: dict[str, Any], d: Path, torch_dtype, max_shard_size) -> int:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    # contiguous, de-aliased copies in the export dtype (safetensors refuses shared storage)
    tensors = {k: v.detach().to("cpu", dtype=torch_dtype if v.is_floating_point() else v.dtype).contiguous().clone()
               for k, v in state.items()}
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size,
                                               filename_pattern="model{suffix}.safetensors")
    for fname, keys in split.filename_to_tensors.items():
        save_file({k: tensors[k] for k in keys}, str(d / fname), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": split.tensor_to_filename}
        (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return len(split.filename_to_tensors)


def _probe(cfg, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    # several concepts and an open one (tokens_per_concept: the segmentation's mean length)
    T = min(cfg.max_seq_len, max(int(4 * (cfg.tokens_per_concept or 1)) + 3, 37))
    return torch.randint(0, cfg.vocab_size, (2, T), generator=g)


def _verify(loaded, d: Path, dtype: str) -> dict[str, Any]:
    import copy

    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    cfg = loaded.config
    x = _probe(cfg)
    src = loaded.model
    with torch.no_grad():
        ref_fp32 = src(x).logits.float()
        if dtype == "bf16":
            rounded = copy.deepcopy(src)
            for p in rounded.parameters():
                p.data = p.data.to(torch.bfloat16).float()
            ref = rounded(x).logits.float()
        else:
            ref = ref_fp32
        hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, trust_remote_code=_remote(src))
        hf.eval()
        got = hf(input_ids=x).logits.float()
    if got.shape != ref.shape:
        raise UserError(f"export check failed: logits shape {tuple(got.shape)} != source {tuple(ref.shape)}")
    diff = (got - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    tol = TOLERANCE * scale
    result = {"max_abs_diff": diff, "tolerance": tol, "probe": list(x.shape),
              "max_abs_diff_vs_fp32_source": (got - ref_fp32).abs().max().item()}
    if not diff <= tol:
        raise UserError(f"export check failed: max |logit difference| {diff:.3g} > tolerance {tol:.3g} "
                        f"on a {x.shape[0]}x{x.shape[1]} probe batch; nothing was written",
                        hint="this is a conversion bug: please report it (rerun with --debug)")
    tok = PreTrainedTokenizerFast.from_pretrained(str(d))
    ours = loaded.tokenizer.encode(PROBE_TEXT, add_special_tokens=False).ids
    theirs = tok(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if ours != theirs or tok.decode(theirs) != loaded.tokenizer.decode(ours):
        raise UserError("export check failed: the exported tokenizer encodes the probe text differently")
    result["tokenizer"] = "identical on the probe text"
    return result
