"""Load a recipe: YAML (+ ``extends:``) < ``--set key.path=value``, then validate everything.

One precedence rule (style rule 5): schema defaults < recipe YAML (a child overrides what it
``extends``) < repeated ``--set``. Every problem (unknown key, wrong type, missing file,
impossible combination) is collected and raised together as one ``UserError`` with one
line per problem: ``FILE: key.path: message``, where FILE is the file (or ``--set``) that
set the key, so a mistake inherited through ``extends:`` points at the right file.
"""

from __future__ import annotations

import copy
import difflib
import glob
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel, ValidationError

from ncpctl.errors import UserError
from ncpctl.model.core.config import ConfigError, ModelConfig, build_config, deep_merge
from ncpctl.recipe.init_from import hf_init_config, init_from_hf, init_from_model
from ncpctl.recipe.length import Budget, Problem, check_train, warmup_steps
from ncpctl.recipe.reuse import expand_from_run
from ncpctl.recipe.yaml_io import MAX_YAML_VALUES, alias_problem, yaml_load, yaml_problem  # noqa: F401  (re-exported)
from ncpctl.recipe.schema import (
    SECTIONS,
    DataSection,
    DeepSpeedSection,
    EvalSection,
    ExportSection,
    ModelSection,
    RunSection,
    TokenizerSection,
    TrainSection,
)

BUILTIN_STDLIB = "builtin:python-stdlib"
UINT16_LIMIT = 65536  # ids 0..65535 fit in uint16


@dataclass
class Recipe:
    """A validated recipe. Sections are the typed pydantic models; derived values below."""

    path: Path
    name: str
    run: RunSection
    data: DataSection
    tokenizer: TokenizerSection
    model: ModelSection
    train: TrainSection
    deepspeed: DeepSpeedSection
    eval: EvalSection
    export: ExportSection
    sets: list[str] = field(default_factory=list)
    world_size: int = 1
    # ---- derived once in load_recipe ----
    run_dir: Path = field(default=Path("."))
    model_config: ModelConfig | None = None
    seq_len: int = 0
    grad_accum_steps: int = 1
    global_batch_size: int = 1
    warmup_steps: int = 0
    decay_steps: int = 0  # train.schedule: wsd: the decay phase's steps (0 with cosine)
    decay_start: dict[str, Any] | None = None  # a decay branch's start (recipe.length.decay_start)
    budget: Budget = field(default_factory=Budget)

    def set_step_cost(self, per_step: int) -> None:
        """Re-resolve a FLOPs budget at another cost of one step (a stage that freezes weights
        trains at less than the full accounting the loader planned with): train.max_steps and the
        warmup follow. Before the engine (and its schedule) is built."""
        if self.budget.kind != "flops":
            return
        self.budget.per_step = per_step
        self.train.max_steps = self.budget.max_steps
        self.warmup_steps = warmup_steps(self.train.warmup_steps, self.train.warmup_fraction, self.train.max_steps)

    def flops_per_step(self, trainable: dict[str, int] | None = None, realised_ratio: float | None = None) -> int:
        """Training FLOPs of one optimizer step of this recipe (its model, seq_len and global batch):
        ``ncpctl.model.accounting.flops.training_flops_per_step``; every weight trains unless ``trainable``
        (name -> element count) says which do; ``realised_ratio``: a measured tokens per concept."""
        from ncpctl.model.accounting.flops import training_flops_per_step

        return training_flops_per_step(self.model_config, self.seq_len, self.global_batch_size,
                                       trainable=trainable, realised_ratio=realised_ratio)

    @property
    def data_dir(self) -> Path:
        return self.run_dir / "data"

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe: every key with its effective value; loadable as a recipe."""
        out: dict[str, Any] = {}
        for name in SECTIONS:
            section: BaseModel = getattr(self, name)
            out[name] = section.model_dump(mode="json")
        out["run"]["dir"] = str(self.run_dir)
        out["run"]["name"] = self.name
        if self.tokenizer.path and Path(self.tokenizer.path).is_file():
            # a given tokenizer's size is the file's: the BPE size key (ignored then) must not say otherwise
            out["tokenizer"]["vocab_size"] = tokenizer_vocab_size(self.tokenizer)
        if self.model_config is not None:  # pin the exact model, not just the size name
            out["model"] = {"size": self.model.size, **self.model_config.to_dict()}
        if self.budget.kind != "steps":  # the budget stays the recipe's key; loading resolves it again
            out["train"]["max_steps"] = None
        out["train"].update(
            seq_len=self.seq_len, grad_accum_steps=self.grad_accum_steps,
            global_batch_size=self.global_batch_size, warmup_steps=self.warmup_steps,
        )
        if self.train.schedule == "wsd":
            out["train"]["decay_steps"] = self.decay_steps
        return out

    def write_resolved(self, directory: Path) -> Path:
        """Write ``recipe.resolved.yaml`` into ``directory`` (atomically, fsynced)."""
        from ncpctl import __version__
        from ncpctl.fsutil import atomic_write

        directory.mkdir(parents=True, exist_ok=True)
        target = directory / "recipe.resolved.yaml"
        header = (
            f"# Resolved by ncpctl {__version__} from {self.path}"
            + (f" with --set {' --set '.join(self.sets)}" if self.sets else "")
            + "\n# Every key with its effective value; usable as a recipe itself.\n"
        )
        return atomic_write(target, header + yaml.safe_dump(self.to_dict(), sort_keys=False))


# ----------------------------------------------------------------------------- reading


def _read_yaml(path: Path, problems: list[str]) -> dict[str, Any] | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        problems.append(f"{path}: file not found")
        return None
    except OSError as e:
        problems.append(f"{path}: cannot read ({e.strerror})")
        return None
    try:
        doc = yaml_load(text)
        bad = alias_problem(doc)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problems.append(f"{path}{where}: invalid YAML ({yaml_problem(e)})")
        return None
    except RecursionError:
        problems.append(f"{path}: YAML nested too deeply")
        return None
    if bad is not None:
        problems.append(f"{path}: {bad}")
        return None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        problems.append(f"{path}: a recipe must be a mapping of sections, got {type(doc).__name__}")
        return None
    return doc


def _record(v: Any, origin: dict[str, str], src: str, key: str) -> None:
    origin[key] = src
    if isinstance(v, dict):
        for k, sub in v.items():
            _record(sub, origin, src, f"{key}.{k}")


def _load_tree(path: Path, problems: list[str], origin: dict[str, str], stack: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The merged dict of ``path`` and everything it ``extends`` (parents first)."""
    if path.resolve() in [p.resolve() for p in stack]:
        chain = " -> ".join(str(p) for p in (*stack, path))
        problems.append(f"{path}: extends: cycle ({chain})")
        return {}
    doc = _read_yaml(path, problems)
    if doc is None:
        return {}
    merged: dict[str, Any] = {}
    parents = doc.pop("extends", None)
    if parents is not None:
        if isinstance(parents, str):
            parents = [parents]
        if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
            problems.append(f"{path}: extends: must be a file name or a list of file names")
            parents = []
        for parent in parents:
            ppath = Path(parent) if os.path.isabs(parent) else path.parent / parent
            if not ppath.exists():
                problems.append(f"{path}: extends: {parent}: file not found")
                continue
            # the parent's own keys were recorded in origin by the recursive call
            merged = deep_merge(merged, _load_tree(ppath, problems, origin, (*stack, path)))
    # this file wins over its parents, and its keys are recorded as set here
    src = str(path)
    return deep_merge(merged, doc, on_leaf=lambda key, v: _record(v, origin, src, ".".join(map(str, key))))


def set_keys(path: str | os.PathLike[str]) -> list[str]:
    """The key paths a recipe file sets itself or through what it ``extends`` (a mapping is walked
    into, any other value, a list too, is one key), in file order: what ``ncpctl sweep`` compares
    with the recipe a finished point's run recorded."""
    tree = _load_tree(Path(path), [], {})
    out: list[str] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            else:
                out.append(f"{prefix}{k}")

    walk(tree, "")
    return out


def parse_set(item: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a","b","c"], YAML-parsed value)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(f"--set: {item}: expected KEY.PATH=VALUE, e.g. --set train.max_steps=10")
    try:
        value = yaml_load(raw) if raw.strip() else ""
        bad = alias_problem(value)
    except yaml.YAMLError:
        value, bad = raw, None  # not valid YAML: take it as a plain string
    except RecursionError:
        bad = "YAML nested too deeply"
    if bad is not None:
        raise UserError(f"--set: {key}: {bad}")
    return key.split("."), value


def _apply_sets(tree: dict[str, Any], sets: Iterable[str], origin: dict[str, str], problems: list[str]) -> None:
    for item in sets:
        try:
            parts, value = parse_set(item)
        except UserError as e:
            problems.extend(e.problems)
            continue
        node = tree
        for i, part in enumerate(parts[:-1]):
            if part not in node:  # a section only this --set names: its problems are the --set's
                origin.setdefault(".".join(parts[: i + 1]), "--set")
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                problems.append(f"--set: {'.'.join(parts[: i + 1])}: is a value, not a section; cannot set {item}")
                break
            node = nxt
        else:
            node[parts[-1]] = value
            _record(value, origin, "--set", ".".join(parts))


# ----------------------------------------------------------------------------- validation


def _loc_to_key(section: str, loc: tuple[Any, ...]) -> str:
    key = section
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else f".{part}"
    return key


def _prune(raw: dict[str, Any], loc: tuple[Any, ...]) -> None:
    """Drop the value at ``loc`` (or the list holding it) so the rest can still validate."""
    node: Any = raw
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, dict) and part in node:
            if last or not isinstance(node[part], (dict, list)) or isinstance(node[part], list):
                del node[part]
                return
            node = node[part]
        else:
            return


def _validate_section(name: str, cls: type[BaseModel], raw: Any) -> tuple[BaseModel | None, list[Problem]]:
    """Validate one section. On errors, report them all, then validate what remains with the
    offending keys removed, so cross-field checks still run on the rest (all errors at once)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        return None, [(name, f"must be a mapping, got {type(raw).__name__}")]
    raw = copy.deepcopy(raw)
    out: list[Problem] = []
    for _ in range(8):  # each round removes at least one key; a handful is plenty
        try:
            return cls.model_validate(raw), out
        except ValidationError as e:
            errors = e.errors()
            out.extend(_describe(name, cls, err) for err in errors)
            for err in errors:
                _prune(raw, tuple(err["loc"]))
    return None, out


def _describe(name: str, cls: type[BaseModel], err: Any) -> Problem:
    loc = tuple(err["loc"])
    key = _loc_to_key(name, loc)
    if err["type"] == "extra_forbidden":
        # the model the unknown key was looked up in, to suggest a near name
        owner: Any = cls
        for part in loc[:-1]:
            f = owner.model_fields.get(part) if isinstance(part, str) else None
            ann = getattr(f, "annotation", None)
            cands = (ann, *getattr(ann, "__args__", ()))
            owner = next((a for a in cands if isinstance(a, type) and issubclass(a, BaseModel)), owner)
        near = difflib.get_close_matches(str(loc[-1]), list(owner.model_fields), n=1)
        return key, "unknown key" + (f" (did you mean '{near[0]}'?)" if near else "")
    got = err.get("input")
    return key, err["msg"] + (f", got {got!r}" if not isinstance(got, (dict, list)) else "")


def _related(a: str, b: str) -> bool:
    """True when key path ``a`` is ``b``, or one is inside the other (``data.sources`` / ``data.sources[0].path``)."""
    return a == b or any(long.startswith(short) and long[len(short)] in ".[" for short, long in ((a, b), (b, a))
                         if len(long) > len(short))


def _origin_of(key: str, origin: dict[str, str], default: str) -> str:
    """The file that set ``key`` (or its closest set ancestor), else ``default``."""
    while key:
        if key in origin:
            return origin[key]
        cut = max(key.rfind("."), key.rfind("["))
        if cut <= 0:
            break
        key = key[:cut]
    return default


def tokenizer_vocab_size(tok: TokenizerSection) -> int:
    """Vocab size the data will have: the file's when ``path`` is set, else the configured one."""
    if tok.path:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(tok.path).get_vocab_size(with_added_tokens=True)
    return tok.vocab_size


def source_kind(path: str, declared: str) -> str:
    if declared != "auto":
        return declared
    if path.startswith("builtin:"):
        return "builtin"
    if path.startswith("hf:"):
        return "hf"
    lower = path.lower()
    for ext, kind in ((".jsonl", "json"), (".json", "json"), (".jsonl.gz", "json"), (".parquet", "parquet")):
        if lower.endswith(ext):
            return kind
    return "text"


def _check_sources(data: DataSection) -> list[Problem]:
    if data.mix:  # the components' own sources (a prefix component needs nothing tokenized)
        listed = [(f"data.mix[{j}].sources[{i}]", src) for j, c in enumerate(data.mix) for i, src in enumerate(c.sources)]
        if not listed:
            return [("data.mix", "every component gives a prefix: there is nothing to tokenize")]
    else:
        listed = [(f"data.sources[{i}]", src) for i, src in enumerate(data.sources)]
    problems: list[Problem] = []
    if not listed:
        problems.append(("data.sources", "no sources given; e.g. sources: [builtin:python-stdlib]"))
    for key, src in listed:
        kind = source_kind(src.path, src.type)
        if kind == "builtin":
            from ncpctl.data.sources import source_problem  # here: that module imports this one

            if (problem := source_problem(src)) is not None:
                problems.append((f"{key}.path", problem))
        elif kind == "hf":
            if not src.path.removeprefix("hf:"):
                problems.append((f"{key}.path", "hf: needs a dataset name, e.g. hf:wikitext"))
        elif not glob.glob(os.path.expanduser(src.path), recursive=True):
            problems.append((f"{key}.path", f"no file matches {src.path!r}"))
    return problems


def _check_mix(data: DataSection) -> list[Problem]:
    """data.mix across its components (each component validated on its own in the schema)."""
    names = [c.name for c in data.mix]
    twice = sorted({n for n in names if names.count(n) > 1})
    problems: list[Problem] = []
    if twice:
        problems.append(("data.mix", f"component names must be unique ({', '.join(twice)} repeated)"))
    if data.mix and data.sources:
        problems.append(("data.mix", "give data.sources or data.mix, not both (a component takes `sources` itself)"))
    if data.mix and not math.isfinite(sum(c.weight for c in data.mix)):
        problems.append(("data.mix", "the weights' sum overflows; scale them down"))
    return problems


def load_recipe(
    path: str | os.PathLike[str],
    sets: Iterable[str] = (),
    *,
    need_sources: bool = False,
    world_size: int | None = None,
) -> Recipe:
    """Read, merge, validate. Raises one ``UserError`` listing every problem found.

    ``need_sources``: also check that every ``data.sources`` entry exists (tokenize).
    ``world_size``: data-parallel ranks for the batch-size check; default ``$WORLD_SIZE`` or 1.
    """
    path = Path(path)
    sets = list(sets)
    top = str(path)
    file_problems: list[str] = []
    origin: dict[str, str] = {}
    tree = _load_tree(path, file_problems, origin)
    if file_problems and not tree:
        raise UserError(*file_problems)
    _apply_sets(tree, sets, origin, file_problems)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)

    problems: list[Problem] = []
    sections: dict[str, BaseModel] = {}
    for key in tree:
        if key not in SECTIONS:  # a key YAML read as a number (1:, 0E0:) or null too
            near = difflib.get_close_matches(str(key), list(SECTIONS), n=1)
            problems.append((str(key), "unknown section" + (f" (did you mean '{near[0]}'?)" if near else
                                                        f"; sections are {', '.join(SECTIONS)}")))
    for name, cls in SECTIONS.items():
        section, errs = _validate_section(name, cls, tree.get(name))
        problems.extend(errs)
        if section is not None:
            sections[name] = section

    name = (sections["run"].name if "run" in sections and sections["run"].name else None) or path.stem
    derived: dict[str, Any] = {}
    # A key that already failed validation was dropped before the cross-field checks, so a
    # check on it (or on its section path) would report a consequence, not a new problem.
    bad = [key for key, _ in problems]
    problems.extend(p for p in _check_combinations(sections, world_size, need_sources, name, derived)
                    if not any(_related(p[0], key) for key in bad))

    lines = list(file_problems)
    lines += [f"{_origin_of(key, origin, top)}: {key}: {msg}" for key, msg in problems]
    lines = list(dict.fromkeys(lines))  # once each (a key pydantic cannot prune is reported every round)
    if lines:
        raise UserError(*lines, hint="fix the recipe (or the --set values) and run again")
    return Recipe(path=path, name=name, sets=sets, world_size=world_size, **sections, **derived)  # type: ignore[arg-type]


def _special_token_ids(cfg: ModelConfig, size: str, overrides: dict[str, Any], tok: TokenizerSection | None,
                       run_dir: Path | None, problems: list[Problem]) -> ModelConfig:
    """The model config with the ids of the special tokens its designs need (``special_tokens``:
    key path -> text, e.g. a [MASK]) read into their keys where the recipe leaves them unset: from
    tokenizer.path's file (missing there: a problem), else from the tokenizer ``ncpctl tokenize``
    wrote into the run's data directory, else where tokenize's BPE puts them (after EOD, in order;
    pretrain checks the data's meta.json against them)."""
    file = Path(tok.path) if tok is not None and tok.path else (run_dir / "data" / "tokenizer.json" if run_dir else None)
    vocab = None
    if file is not None and file.is_file():
        from tokenizers import Tokenizer

        try:
            vocab = Tokenizer.from_file(str(file)).get_vocab()
        except Exception:  # a broken tokenizer.path is reported already; a broken data one: tokenize again
            vocab = None
    for i, (key, text) in enumerate(cfg.special_tokens().items()):
        *parents, leaf = key.split(".")
        node = overrides
        for part in parents:
            node = node.setdefault(part, {})
        if node.get(leaf) is not None:
            continue
        if vocab is not None and text in vocab:
            node[leaf] = vocab[text]
        elif vocab is not None and tok is not None and tok.path:  # (a missing file is reported already)
            problems.append(("tokenizer.path", f"{tok.path} has no {text!r} token, which model.{key} needs "
                                               f"(model.objective: {cfg.objective}); use a tokenizer that has it"))
            node[leaf] = 1 + i  # a placeholder, so the other checks still run
        else:
            node[leaf] = 1 + i
    return build_config(size, **overrides)


def _config_without(size: str, overrides: dict[str, Any], bad: list[str]) -> ModelConfig | None:
    """The model config with the offending overrides dropped, so the other checks that need
    it (sequence length, concept block size) still run; None if it is still impossible."""
    trimmed = copy.deepcopy(overrides)
    for key in bad:
        *parents, leaf = key.split(".")
        node = trimmed
        for part in parents:
            node = node.get(part, {})
        node.pop(leaf, None)
    try:
        return build_config(size, **trimmed)
    except ConfigError:
        return None


def _check_combinations(
    s: dict[str, Any], world_size: int, need_sources: bool, name: str, derived: dict[str, Any]
) -> list[Problem]:
    """Cross-field checks over the sections that validated on their own."""
    problems: list[Problem] = []
    run, data, tok, model, train = (s.get(k) for k in ("run", "data", "tokenizer", "model", "train"))

    if run is not None:
        run_dir = Path(os.path.expanduser(run.dir.replace("{name}", name)))
        derived["run_dir"] = run_dir
        if run_dir.exists() and not run_dir.is_dir():
            problems.append(("run.dir", f"{run_dir} exists and is not a directory"))
    problems += expand_from_run(data, tok)  # data.from_run: before the data and tokenizer checks below

    vocab: int | None = None
    cfg: ModelConfig | None = None
    if tok is not None:
        if tok.path:
            if not Path(tok.path).is_file():
                problems.append(("tokenizer.path", f"file not found: {tok.path}"))
            else:
                try:
                    vocab = tokenizer_vocab_size(tok)
                except Exception as e:  # tokenizers raises a bare Exception on a bad file
                    problems.append(("tokenizer.path", f"not a valid tokenizer.json ({str(e).splitlines()[0]})"))
        else:
            vocab = tok.vocab_size

    if data is not None:
        problems += _check_mix(data)
        if need_sources and not data.train_prefix:
            problems.extend(_check_sources(data))
        for key in ("train_prefix", "val_prefix"):
            prefix = getattr(data, key)
            if prefix:
                missing = [ext for ext in (".bin", ".idx") if not Path(prefix + ext).is_file()]
                if missing:
                    problems.append((f"data.{key}", f"{prefix}{' and '.join(missing)} not found (a Megatron dataset prefix)"))
        if vocab is not None and data.dtype == "uint16" and vocab > UINT16_LIMIT:
            problems.append(("data.dtype", f"uint16 holds ids below {UINT16_LIMIT}, but the tokenizer has {vocab} tokens; use int32 or auto"))

    base = init_from_model(train, problems) if model is not None and not model.model_fields_set else None
    if base is not None:
        # midtrain / adapt-vq with no `model:` section: the checkpoint describes the model
        # (style rule 7), so the recipe needs only train.init_from
        derived["model_config"] = cfg = base
    elif model is not None and init_from_hf(train):
        cfg = hf_init_config(model, train.init_from, problems)
        if cfg is not None:
            derived["model_config"] = cfg
    elif model is not None:
        overrides = model.model_dump(exclude={"size"}, exclude_none=True)
        if overrides.get("vocab_size") is None and vocab is not None:
            overrides["vocab_size"] = vocab
        elif vocab is not None and overrides["vocab_size"] < vocab:
            problems.append(("model.vocab_size", f"{overrides['vocab_size']} is smaller than the tokenizer's {vocab} tokens"))
        try:
            derived["model_config"] = cfg = build_config(model.size, **overrides)
            if cfg.special_tokens():
                derived["model_config"] = cfg = _special_token_ids(cfg, model.size, overrides, tok,
                                                                   derived.get("run_dir"), problems)
        except ConfigError as e:
            problems.extend((f"model.{k}", m) for k, m in e.problems)
            cfg = _config_without(model.size, overrides, [k for k, _ in e.problems])

    if train is not None:
        problems += check_train(train, cfg, world_size, derived)
    problems += _check_deepspeed(s.get("deepspeed"), train)
    return problems


def _check_deepspeed(ds: Any, train: Any) -> list[Problem]:
    """The deepspeed section against the train section, which owns batch sizes, clipping, precision
    and the optimizer."""
    problems: list[Problem] = []
    if ds is not None and train is not None and train.optimizer == "muon":
        # Muon orthogonalises whole matrices; ncpctl.train.muon knows the flat layouts of stages 0-2
        if ds.zero_stage == 3:
            problems.append(("deepspeed.zero_stage", "3 partitions every matrix across ranks; train.optimizer: "
                             "muon runs at ZeRO stage 0, 1 or 2"))
        if ds.offload_optimizer:
            problems.append(("deepspeed.offload_optimizer", "not supported with train.optimizer: muon"))
    if ds is not None:
        # one source of truth: the train section owns batch sizes, clipping and precision
        owned = {"train_batch_size": "train.global_batch_size", "train_micro_batch_size_per_gpu":
                 "train.micro_batch_size", "gradient_accumulation_steps": "train.grad_accum_steps",
                 "gradient_clipping": "train.grad_clip", "bf16.enabled": "train.precision",
                 "fp16.enabled": "train.precision (fp16 is not supported; use bf16)",
                 "optimizer": "train.lr / betas / eps / weight_decay", "scheduler": "train.lr / min_lr / warmup_*",
                 "zero_optimization.stage": "deepspeed.zero_stage"}
        for key, what in owned.items():
            head, _, leaf = key.partition(".")
            if head in ds.extra and (not leaf or (isinstance(ds.extra[head], dict) and leaf in ds.extra[head])):
                problems.append((f"deepspeed.extra.{key}", f"set by ncpctl from {what}; set that instead"))
    return problems
