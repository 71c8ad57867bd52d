"""The recipe schema: one typed section per concern, each field documented once, here.

A recipe is YAML with top-level sections ``run``, ``data``, ``tokenizer``, ``model``,
``train``, ``deepspeed``, ``eval``, ``export`` (plus ``extends:``). Every section is a
strict pydantic model with ``extra="forbid"``, so unknown keys and wrong types are errors.
The ``model`` section is generated from ``ModelConfig`` (the one place model fields are
declared): ``size`` picks a named size and every other key overrides it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from ncpctl.model.designs.bottleneck.config import BottleneckConfig
from ncpctl.model.core.config import ConceptConfig, ModelConfig
from ncpctl.model.designs.causal_diffusion.config import DiffusionConfig


class Section(BaseModel):
    # strict: YAML already typed the values; "3" for an int or `true` for an int is a mistake.
    # No recipe float may be .inf or .nan (a learning rate of .inf trains to NaN silently).
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=False, allow_inf_nan=False)


class RunSection(Section):
    dir: str = Field("runs/{name}", description="Everything the recipe produces goes under this "
                     "directory ({name} = the recipe's file stem). Relative paths are relative to the current directory.")
    name: Optional[str] = Field(None, description="Run name used in logs; default: the recipe's file stem.")


class SourceSpec(Section):
    """One corpus source. A bare string in YAML is shorthand for ``{path: STRING}``."""

    path: str = Field(..., description="A local file or glob (`.txt`, `.jsonl`/`.json`, `.parquet`), "
                      "`builtin:python-stdlib`, `builtin:python-packages` (the `.py` files of the installed "
                      "packages, one document per file, deduplicated; documents per package in meta.json; select with "
                      "`builtin:python-packages:include=sympy+numpy` or `:exclude=torch`), "
                      "or `hf:NAME` for a dataset on a reachable hub.")
    type: Literal["auto", "text", "json", "parquet", "hf", "builtin"] = Field(
        "auto", description="Source kind; `auto` infers it from `path`.")
    field: str = Field("text", description="Column holding the text (json, parquet, hf).")
    split: str = Field("train", description="Dataset split to read (hf).")
    name: Optional[str] = Field(None, description="Dataset configuration name (hf).")
    sample_by: Literal["document", "line", "paragraph"] = Field(
        "document", description="Text files: one document per file, per line or per blank-line paragraph.")
    include_tests: bool = Field(False, description="builtin sources: also include test suites (directories "
                                "named `test`, `tests`, `idle_test`).")


class HeldoutSource(SourceSpec):
    """A held-out corpus for ``ncpctl eval``: a ``data.sources`` entry plus the task name it is reported under."""

    label: Optional[str] = Field(None, description="Task name in the results (letters, digits, `_.-`); default "
                                 "`heldout_` + a slug of the path's last two parts (`~/notes/*.md` -> "
                                 "`heldout_notes_md`, `builtin:python-stdlib` -> `heldout_python_stdlib`).")


class MixComponent(Section):
    """One component of a weighted mixture (``data.mix``): a dataset given by ``prefix`` or made from
    ``sources`` by ``ncpctl tokenize``, drawn with probability ``weight / sum(weights)``."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="The component's name (letters, digits, "
                      "`_.-`): its directory under run.dir/mix/ and its validation keys (`loss/NAME`).")
    weight: float = Field(..., gt=0, description="Sampling weight (> 0; normalised over the components).")
    prefix: Optional[str] = Field(None, description="An existing Megatron dataset (PREFIX.bin/.idx) for training.")
    val_prefix: Optional[str] = Field(None, description="With `prefix`: its validation dataset (optional; "
                                      "the component then gets its own validation loss).")
    sources: list[SourceSpec] = Field(default_factory=list, description="Or corpora (as `data.sources`) that "
                                      "`ncpctl tokenize` writes to run.dir/mix/NAME/data/{train,val}.")

    @field_validator("sources", mode="before")
    @classmethod
    def _bare_strings(cls, v: Any) -> Any:
        return DataSection._bare_strings(v)

    @model_validator(mode="after")
    def _one_kind(self) -> "MixComponent":
        if (self.prefix is None) == (not self.sources):
            raise ValueError(f"component {self.name!r}: give exactly one of `prefix` or `sources`")
        if self.val_prefix is not None and self.prefix is None:
            raise ValueError(f"component {self.name!r}: `val_prefix` goes with `prefix` (tokenize writes the "
                             "validation split of `sources`)")
        return self


class DataSection(Section):
    sources: list[SourceSpec] = Field(default_factory=list, description="Corpora to tokenize, in order "
                                      "(a bare string is shorthand for `{path: STRING}`).")
    val_fraction: float = Field(0.01, description="Fraction of documents held out for validation "
                                "(deterministic per document from `split_seed`; with two or more documents "
                                "each split keeps at least one).", ge=0.0, lt=1.0)
    split_seed: int = Field(1234, ge=0, lt=2**64, description="Seed of the train/validation split (a uint64).")
    dtype: Literal["auto", "uint16", "int32"] = Field(
        "auto", description="Token dtype of the .bin files; auto = uint16 when vocab < 65500 else int32.")
    batch_documents: int = Field(1024, gt=0, description="Documents per encode batch.")
    min_chars: int = Field(1, ge=0, description="Documents shorter than this (in characters) are dropped.")
    max_documents: Optional[int] = Field(None, gt=0, description="Stop after this many documents (smoke tests).")
    labels: Literal["none", "python-ast", "field"] = Field(
        "none", description="Concept labels written next to the token stream (PREFIX.labels.npy, vocabulary in "
        "meta.json; the bottleneck's labelled concepts): `python-ast` = the built-in labeller of Python sources "
        "(ast nodes: class/function definitions, exception handling, regular expressions, file I/O, decorators, "
        "type hints, string formatting, tests, ...), `field` = each JSON record's `labels_field`.")
    labels_field: str = Field("concepts", description="With `labels: field`: the record field holding a list of "
                              "names (document labels) or {concept, start, end} character spans.")
    from_run: Optional[str] = Field(None, description="Train on another run's tokenized data: its run directory "
                                    "(or its data/ directory). Sets data.train_prefix, data.val_prefix and "
                                    "tokenizer.path to that data's train, val and tokenizer.json; nothing to tokenize. "
                                    "E.g. `--set data.from_run=runs/debug`.")
    train_prefix: Optional[str] = Field(None, description="Use an existing Megatron dataset (PREFIX.bin/.idx, "
                                        "e.g. the pre-tokenized Pile) for training instead of `run.dir/data/train`.")
    val_prefix: Optional[str] = Field(None, description="Existing Megatron dataset for validation.")
    document_mask: bool = Field(
        False, description="Keep the documents packed into a training window apart (GPT-NeoX's and Megatron's "
        "reset_attention_mask and reset_position_ids): attention is block-diagonal by document, positions restart "
        "at each document's first token, concept segments never cross a document boundary (fixed blocks count from "
        "each document's start and a block cut by a document's end is dropped; DLCM starts a segment at every "
        "document), and a token uses its own document's concepts only. Document boundaries come from the "
        "dataset's index (each document a sequence ending in EOD); the position of a document's EOD still predicts "
        "the next document's first token. Causal objectives; not with the concept bottleneck. Decoding is unaffected (one document per sequence).")
    mix: list[MixComponent] = Field(
        default_factory=list, description="A weighted mixture instead of one dataset (Megatron's and GPT-NeoX's "
        "blend): a list of `{name, weight, prefix | sources}`. Weights are normalised; global sample i is drawn "
        "from the component k with the largest w_k (i+1) - n_k (n_k: its samples so far), so every prefix of the "
        "order holds each component's share to within one sample, and each component's windows come in their own "
        "shuffled order, epoch after epoch. Resumable and sharded over ranks as one dataset. Validation: each "
        "component with a validation split (`sources`, or `val_prefix`) is evaluated on its own (`loss/NAME`, ...; "
        "round(train.eval_batches x w) batches, at least one) and `loss` is their weighted mean; with none, "
        "data.val_prefix or run.dir/data/val. Every component must use one tokenizer (checked from meta.json). "
        "data.train_prefix, when set, replaces the mixture (one pre-blended dataset).")

    @field_validator("sources", mode="before")
    @classmethod
    def _bare_strings(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"path": x} if isinstance(x, str) else x for x in v]
        return v


class TokenizerSection(Section):
    path: Optional[str] = Field(None, description="Load this tokenizer.json (e.g. Pythia's) instead of training one.")
    vocab_size: int = Field(8192, gt=0, description="Vocabulary size of the byte-level BPE to train "
                            "(ignored when `path` is set: the file's size is used).")
    min_frequency: int = Field(2, ge=1, description="BPE: minimum pair frequency to merge.")
    train_max_bytes: int = Field(50_000_000, gt=0, description="BPE training reads at most this many bytes of text.")
    eod_token: str = Field("<|endoftext|>", description="Token appended after every document.")


def _model_section(dc: type, name: str, nested: dict[str, type] | None = None) -> type[BaseModel]:
    """A pydantic section whose keys are ``dc``'s init fields, all optional overrides: its own
    first, then those of the design sections it composes (ncpctl.model.config_*), in their order."""
    hints = typing.get_type_hints(dc)
    own = vars(dc).get("__annotations__", {})
    fields: dict[str, Any] = {}
    for f in sorted(dataclasses.fields(dc), key=lambda f: f.name not in own):
        if not f.init:
            continue
        tp = nested.get(f.name) if nested and f.name in nested else hints[f.name]
        fields[f.name] = (Optional[tp], Field(None, description=f.metadata.get("doc")))
    return create_model(name, __base__=Section, **fields)


ConceptSection = _model_section(ConceptConfig, "ConceptSection")
BottleneckSection = _model_section(BottleneckConfig, "BottleneckSection")
DiffusionSection = _model_section(DiffusionConfig, "DiffusionSection")
# model.options.NAME.KEY: the keys registered designs declare (ModelConfig checks them against
# the design's options dataclass; the reference lists them: ``design_options``)
_ModelOverrides = _model_section(ModelConfig, "_ModelOverrides",
                                 nested={"concept": ConceptSection, "bottleneck": BottleneckSection, "diffusion": DiffusionSection,
                                         "options": dict[str, dict[str, Any]]})


def design_options() -> list[tuple[str, str, type]]:
    """(name, extension point, options dataclass) of every registered design that declares recipe
    keys (``options``, ncpctl.model.register), in registration order."""
    from ncpctl.model.core.config import OPTIONS

    return [(name, kind, options) for name, (kind, options) in OPTIONS.items()]


class ModelSection(_ModelOverrides):  # type: ignore[valid-type,misc]
    size: str = Field("debug", description="Named size (see `ncpctl.model.core.config.SIZES`); every other key "
                      "overrides it. `vocab_size` defaults to the tokenizer's.")


class LoraSection(Section):
    rank: int = Field(..., gt=0, description="Setting train.lora makes `ncpctl midtrain` a LoRA run (NCP-ArchPreview "
                      "Sec. 5.1's baseline) instead of full fine-tuning: every weight frozen, peft adapters of this rank "
                      "r trained (A: r x in, B: out x r); checkpoints hold them merged into the weights "
                      "(ncpctl.train.lora). Needs peft (`pip install 'ncpctl[lora]'`).")
    alpha: Optional[float] = Field(None, gt=0, description="The update is (alpha / rank) B A; null = 2 x rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    targets: list[str] = Field(["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"], min_length=1,
                               description="Modules that get adapters, as suffixes of their paths (peft's "
                               "target_modules): the fused attention input and output projections and the MLP's "
                               "two matrices of every token and concept layer.")


class DrafterSection(Section):
    k: int = Field(8, gt=0, description="Setting train.drafter makes `ncpctl train-drafter` train the block-parallel "
                   "drafter of NCP-ArchPreview Sec. 5.3 against the frozen target train.init_from "
                   "(ncpctl.model.designs.drafter.module): K, the tokens it proposes per round (its block size).")
    layers: Optional[list[Annotated[int, Field(ge=0)]]] = Field(
        None, description="Target token layers whose outputs the drafter mixes; null = five spread evenly (the report's).")
    n_layers: int = Field(2, gt=0, description="Draft transformer layers (the target's width, heads and FFN).")
    window: int = Field(32, gt=0, description="Latest verified positions whose target states the draft block reads.")
    concept_injection: bool = Field(False, description="Eq. 26: tanh(g_l) * RMSNorm_l(c) added to every draft "
                                    "slot before draft layer l, g zero-initialised (so it starts as the baseline).")
    concept_source: Literal["pooled", "predicted"] = Field(
        "pooled", description="c of Eq. 26: `pooled` = the mean of the target's encoder output over the last "
        "complete block of the verified prefix; `predicted` = the target's concept prediction made from that block, as its coupling adds it to the next "
        "tokens (norm(pred) with `concept.add: normed`).")
    anchors: int = Field(16, gt=0, description="Anchors (draft blocks) per training window, drawn uniformly.")
    decay: Optional[float] = Field(None, gt=0, description="Slot i's loss weight exp(-i / decay) (DFlash: 7 at "
                                   "K = 16; a draft is accepted as a prefix, so early slots count more); null = uniform.")


class WandbSection(Section):
    project: str = Field(..., min_length=1, description="Setting train.wandb logs the run to Weights & Biases "
                         "(`ncpctl.train.tracking`; needs `pip install 'ncpctl[wandb]'`), from rank 0: every "
                         "metrics.jsonl record as `SPLIT/KEY` at its step (the TensorBoard names), the resolved recipe "
                         "as the run config, and with train.plots the PNGs as images. The W&B run id is kept in "
                         "run.dir, so a resumed job continues the same W&B run. This key: the W&B project.")
    entity: Optional[str] = Field(None, description="W&B entity (user or team); null = your default entity.")
    name: Optional[str] = Field(None, description="W&B run name; null = run.name (the recipe's file stem).")
    mode: Optional[Literal["online", "offline", "disabled"]] = Field(
        None, description="`online`, `offline` (files under $WANDB_DIR, else run.dir/wandb; `wandb sync` uploads "
        "them later) or `disabled`; null = $WANDB_MODE, else online.")


class TrainSection(Section):
    max_steps: Optional[int] = Field(
        None, gt=0, le=2**53, description="Optimizer steps to run (at most 2**53: the schedule's step / max_steps is "
        "exact in float64 up to there); null = 100, unless train.max_tokens or train.max_flops gives the length. "
        "Exactly one of the three may be set: a recipe that extends one with max_steps sets `max_steps: null` "
        "beside its budget.")
    max_tokens: Optional[int] = Field(
        None, gt=0, description="A token budget instead of max_steps: max_steps = floor(max_tokens / (global_batch_size "
        "x seq_len)), so the run stops within one optimizer step of it (a budget below one step is an error). The "
        "resolved steps and the budget are in every checkpoint's ncpctl.json and the `--json` summary (`budget`).")
    max_flops: Optional[float] = Field(
        None, gt=0, description="A compute budget instead of max_steps: max_steps = floor(max_flops / F), F the exact "
        "training FLOPs of one optimizer step (`ncpctl.model.accounting.flops.exact_flops`: matmuls with the real shapes, "
        "forward and backward, the MFU numerator; `ncpctl fit` counts a run's compute the same way). A stage that freezes weights (adapt-vq, LoRA) "
        "counts the backward it really does; a learned segmentation (DLCM) is planned at its target R, and the summary "
        "adds the FLOPs at the tokens per concept it realised (`budget.flops_realised`).")
    seed: int = Field(1234, ge=0, lt=2**32, description="Seed for init, data order and dropout (below 2**32, "
                      "numpy's seed range).")
    seq_len: Optional[int] = Field(None, gt=0, description="Tokens per training window; default model.max_seq_len.")
    micro_batch_size: int = Field(1, gt=0, description="Sequences per rank per forward/backward.")
    global_batch_size: Optional[int] = Field(None, gt=0, description="Sequences per optimizer step over all ranks; "
                                             "must equal micro_batch_size x grad_accum_steps x world size.")
    grad_accum_steps: Optional[int] = Field(None, gt=0, description="Micro-batches per optimizer step; "
                                            "derived from global_batch_size when omitted.")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="`adamw`, or `muon` (NCP-ArchPreview §3.6, Moonlight): Newton-Schulz-orthogonalised "
        "Nesterov momentum (torch.optim.Muon's update) for the hidden matrices, i.e. the weights of every "
        "nn.Linear except the LM head, the concept heads, the codebook and depth mixers; AdamW for the rest. "
        "One lr and one weight decay for both (decoupled; Muon decays with the unadjusted lr). ZeRO stage 0-2 "
        "(not 3, not with deepspeed.offload_optimizer). The paper: muon at lr 6e-5 with a cosine schedule.")
    muon_lr_scale: Literal["match_rms_adamw", "sqrt_max_dim"] = Field(
        "match_rms_adamw", description="Muon step size of a (d_out, d_in) matrix: lr x 0.2 sqrt(max(d_in, d_out)) "
        "(`match_rms_adamw`, Moonlight: the update RMS of AdamW, so AdamW's lr and weight decay carry over) or "
        "lr x sqrt(max(d_in, d_out)) (`sqrt_max_dim`, NCP-ArchPreview Eq. 25 as written).")
    muon_momentum: float = Field(0.95, gt=0, lt=1, description="Muon momentum (Nesterov; torch.optim.Muon's default).")
    lr: float = Field(6e-4, gt=0, description="Peak learning rate (Pythia: 6e-4). Under decoupled muP "
                      "(model.mup_base_width) the base rate of everything outside the hidden matrices (DLCM Sec. "
                      "6.1.1's eta_base_others: embeddings, norms, biases, the LM head, ...).")
    mup_lr_token: Optional[float] = Field(
        None, gt=0, description="Decoupled muP (model.mup_base_width): eta_base_token of DLCM Sec. 6.1.1, the "
        "base lr of the token module's hidden matrices, which train at mup_lr_token / s_token; null = train.lr. "
        "The schedule scales it as train.lr (to min_lr / lr of it at the end).")
    mup_lr_concept: Optional[float] = Field(
        None, gt=0, description="Decoupled muP: eta_base_concept, the base lr of the concept module's hidden "
        "matrices (concept layers and heads), which train at mup_lr_concept / s_concept; null = train.lr.")
    min_lr: float = Field(6e-5, ge=0, description="Final learning rate of the decay (cosine's, or WSD's).")
    schedule: Literal["cosine", "wsd"] = Field(
        "cosine", description="Learning-rate schedule after the linear warmup: `cosine` = cosine from lr to min_lr "
        "over the remaining steps; `wsd` = warmup-stable-decay (MiniCPM; DLCM Sec. 6.2.3): lr held constant, then "
        "the last train.decay_steps steps decay to min_lr with train.decay_shape. A stable-phase checkpoint of a "
        "WSD run can start decay branches (train.decay_from).")
    decay_steps: Optional[int] = Field(None, ge=1, description="WSD: steps of the decay phase (overrides "
                                       "decay_fraction); with train.decay_from, the length of the branch.")
    decay_fraction: float = Field(0.1, gt=0, le=1, description="WSD: the decay phase as a fraction of max_steps "
                                  "(rounded to whole steps).")
    decay_shape: Literal["linear", "cosine", "sqrt"] = Field(
        "sqrt", description="WSD: the decay's shape, lr(p) = min_lr + (lr - min_lr) f(p) at p = the fraction of the "
        "decay done: `linear` f = 1 - p; `cosine` f = (1 + cos(pi p)) / 2; `sqrt` f = 1 - sqrt(p) (the \"1-sqrt\" "
        "cooldown of Haegele et al. 2024).")
    decay_from: Optional[str] = Field(
        None, description="WSD decay branch (`ncpctl pretrain`, or the stage that wrote the checkpoint): a stable-phase "
        "checkpoint (or run directory) of a WSD run. This run, in its own run.dir, takes its weights, optimizer "
        "state, data position and step s and runs only the decay: max_steps = s + train.decay_steps (a max_steps in "
        "the recipe is replaced). Equals the WSD run whose decay starts at s, bit for bit at one thread "
        "(OMP_NUM_THREADS=1), so one stable run yields many budgets. `train.resume: auto` continues the branch's own checkpoints first. "
        "A run directory is resolved once, to its newest checkpoint when the branch starts; the branch's checkpoints "
        "record it (with its step and validation losses) and are continued from it however far the stable run goes on; "
        "a value that no longer names it is refused.")
    warmup_fraction: float = Field(0.01, ge=0, le=1, description="Linear warmup as a fraction of max_steps.")
    warmup_steps: Optional[int] = Field(None, ge=0, description="Linear warmup in steps (overrides warmup_fraction).")
    betas: list[Annotated[float, Field(ge=0, lt=1)]] = Field([0.9, 0.95], min_length=2, max_length=2,
                                                            description="AdamW betas (beta1, beta2), each in [0, 1).")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay of the matrices (AdamW's and, "
                                "with train.optimizer: muon, Muon's); none on norms, biases, embeddings, mixers.")
    grad_clip: float = Field(1.0, ge=0, description="Gradient norm clipping (0 disables).")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto = bf16 on GPU, fp32 on CPU.")
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none", description="Recompute activations in the backward pass instead of keeping them "
        "(torch.utils.checkpoint, per block of every stack): `full` keeps only each block's input and reruns the "
        "block (about one more forward per step, the least activation memory); `selective` keeps the block "
        "outputs and recomputes the attention and MLP internals (q, k, v, attention output, MLP hidden); "
        "`none` keeps everything. Losses and gradients are unchanged.")
    compile: Union[bool, Literal["auto"]] = Field(
        "auto", description="torch.compile each block's forward in every stack, and the depth mixers between them "
        "(IRC, CRC, Block AttnRes) (inductor; the rest stays eager; at ZeRO-3 each block gathers its weights at "
        "once). `auto` = on a GPU, off on a CPU (where inductor's kernels are about as fast as eager ones and "
        "compiling costs a minute). Where it cannot (a CPU without a C++ compiler) the run goes on eagerly with one "
        "warning line saying why. The loss equals eager mode's to float rounding.")
    eval_every: int = Field(50, ge=0, description="Validation every N steps (0 = only at the end).")
    eval_batches: int = Field(8, gt=0, description="Validation batches per evaluation.")
    eval_tasks: list[str] = Field(
        default_factory=list, description="Downstream evaluation inside the run (as gpt-neox and OLMo-core do): "
        "lm-eval task or group names (as eval.tasks: `ncp_offline`, the paper tables, any lm-eval task), scored "
        "by the live model through the same lm-eval model as `ncpctl eval` (no checkpoint written or read), "
        "with eval.limit, eval.num_fewshot and eval.batch_size, every train.eval_tasks_every steps and at the "
        "end; every rank scores the same requests (ZeRO-3 gathers each layer on all ranks). Logged as a "
        "`\"split\": \"downstream\"` record of `eval/<task>/<metric>` keys in metrics.jsonl (and "
        "`downstream.png` with train.plots); its time is kept out of step_time and the rates, and the RNG "
        "state is put back, so training is the same as without it. An unknown name is an error before "
        "training starts.")
    eval_tasks_every: int = Field(0, ge=0, description="Steps between in-loop downstream evaluations of "
                                  "train.eval_tasks (0 = only at the end of the run).")
    save_every: int = Field(100, ge=0, description="Checkpoint every N steps (0 = only at the end).")
    keep_last: int = Field(2, gt=0, description="Checkpoints kept on disk.")
    resume: str = Field("auto", description="`auto` (newest complete checkpoint), `never`, or a checkpoint path.")
    init_from: Optional[str] = Field(None, description="midtrain/adapt-vq: checkpoint, run directory or HF "
                                     "directory to start from; a recipe without a `model:` section takes the checkpoint's model.")
    load: Literal["weights", "all"] = Field("weights", description="midtrain: load weights only (fresh optimizer) or everything.")
    lora: Optional[LoraSection] = Field(None, description="midtrain: LoRA adapters instead of full fine-tuning "
                                        "(see train.lora.rank); null = every weight trains.")
    drafter: Optional[DrafterSection] = Field(None, description="train-drafter: the block-parallel drafter to "
                                              "train against train.init_from (see train.drafter.k).")
    zero_concept_output: bool = Field(False, description="midtrain from a Hugging Face directory: start the codebook's "
                                      "output projection at zero, so step 0 computes exactly the base model's logits.")
    max_nonfinite: int = Field(5, gt=0, description="Abort after this many non-finite steps in a row.")
    log_every: int = Field(1, gt=0, description="Write metrics every N steps; where stderr is not a terminal (nohup, Slurm, | tee) also print one plain progress line (step, ETA, loss terms).")
    attention_stats_every: int = Field(
        100, ge=0, description="Stability diagnostics (NCP-ArchPreview Sec. 4.6, Figs. 5-6) at step 1 and every N-th "
        "step (0 = off): per attention layer the max attention logit over the visible pairs and the max per-head "
        "query and key norm (`NCPModel.attention_stats`), from one extra no-grad forward of the step's first "
        "micro-batch before its update, max over ranks; a `\"split\": \"stability\"` record in metrics.jsonl "
        "(`attn/max_logit`, `attn/{layer}/max_q_norm`, ...) and, with train.plots, `attention_stats.png`. "
        "On by default: the cost is one forward of one micro-batch per N steps (0.3% of training at N=100 with "
        "one micro-batch per step, less with accumulation), and a run that diverged can be diagnosed only if "
        "the curves were recorded before it did.")
    plots: bool = Field(False, description="Write PNG loss curves, codebook-usage histograms and (with "
                        "train.attention_stats_every) the attention stability curves.")
    tensorboard: bool = Field(False, description="Also log to TensorBoard (needs `tensorboard`).")
    wandb: Optional[WandbSection] = Field(None, description="Also log to Weights & Biases (see train.wandb.project); "
                                          "null = not.")


class DeepSpeedSection(Section):
    zero_stage: Literal[0, 1, 2, 3] = Field(1, description="ZeRO stage.")
    offload_optimizer: bool = Field(False, description="ZeRO-Offload the optimizer state to CPU.")
    extra: dict[str, Any] = Field(default_factory=dict, description="Merged last into the generated DeepSpeed config.")


class EvalSection(Section):
    tasks: list[str] = Field(default_factory=list, description="lm-eval task or group names: `ncp_offline` "
                             "(held-out perplexity, next-block cloze, last-identifier completion from the "
                             "validation split; no network), `conceptlm` / `conceptlm_downstream` / "
                             "`conceptlm_ppl` (the ConceptLM paper's benchmarks; need the hub or a cache, but "
                             "`conceptlm_val_ppl`: the run's validation split), "
                             "or any lm-eval task.")
    batch_size: int = Field(8, gt=0, description="Requests per batch.")
    limit: Optional[int] = Field(None, gt=0, description="Examples per task (smoke runs).")
    num_fewshot: Optional[int] = Field(None, ge=0, description="Few-shot examples.")
    heldout: list[HeldoutSource] = Field(default_factory=list, description="Held-out corpora of your own, scored as "
                                         "perplexity tasks next to `tasks`: token, word and byte perplexity and bits "
                                         "per byte, tokenized with the checkpoint's tokenizer, rolling windows of the "
                                         "model's `max_seq_len`. Entries as in `data.sources` (a bare string is a "
                                         "path or glob) plus `label`; `ncpctl eval --heldout` replaces this list.")

    @field_validator("heldout", mode="before")
    @classmethod
    def _bare_strings(cls, v: Any) -> Any:  # as data.sources: a bare string is {path: STRING}
        return DataSection._bare_strings(v)


class ExportSection(Section):
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="Weight dtype of the export.")
    out: Optional[str] = Field(None, description="Recorded only: `ncpctl export` writes to its `--out`, else "
                               "run.dir/export; a checkpoint's recipe never chooses where an export writes (a "
                               "shared checkpoint could name any directory).")
    verify: bool = Field(True, description="Reload the export and compare logits with the source.")
    max_shard_size: str = Field("5GB", description="Shard safetensors above this size.")


SECTIONS: dict[str, type[BaseModel]] = {
    "run": RunSection,
    "data": DataSection,
    "tokenizer": TokenizerSection,
    "model": ModelSection,
    "train": TrainSection,
    "deepspeed": DeepSpeedSection,
    "eval": EvalSection,
    "export": ExportSection,
}
