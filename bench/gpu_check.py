"""One-shot GPU check: bf16 training step and MFU next to a plain-PyTorch reference, SDPA backend,
ZeRO-1/2, cached decoding (eager and CUDA graphs), ConceptLM/PM step ratio, NCP-ArchPreview, DLCM,
CDLM, real runs, Liger's fused loss, and issue 45's goals. A script, not a test; run it once when a
GPU is lent and paste its output into the report (the call and the wheels it carries:
docs/gpu/README.md, "Issue 45's check").

    python bench/gpu_check.py --json gpu_check.json     # on one H100/H200-class GPU, ~5 min
    python bench/gpu_check.py --only train_step,decode  # some sections (in this process)
    python bench/gpu_check.py --dry --json -            # CPU smoke run of the same code (~25 s)

Runtime on one H200 (2026-12-04, docs/gpu/README.md): 127 s of sections 1-8 in run 5 plus imports;
section 9, the reference's compile, section 4's own process and section 10 were added after it
and are not timed on a GPU yet; the shapes were trimmed so that the whole is about 4.5-5 minutes
(a rerun must fit a session's 15 minutes of device time). The
JSON is rewritten after every section, so a run cut short still leaves what it measured;
a section that fails is recorded under ``errors`` (message and traceback) and the others
still run. ``checks`` holds the correctness verdicts (finite losses, flash attention, equal
ZeRO-1/2 first losses, cached decode == full forward, Liger == ours); ``goals`` issue 45's speed
goals (value, goal, met: not checks). Exit code 0 when every section ran and
every check holds, 1 otherwise. Without CUDA (and without ``--dry``) it exits with code 2
and one line. ``--precision bf16|fp32`` overrides the precision (default: bf16 on a GPU).
Every MFU counts attention FLOPs in full (``exact_flops(...).training_per_step()``, issue 40's
convention; ``mfu_causal`` is the causal count).

Everything trains the way ``ncpctl pretrain`` trains on a GPU: a recipe (``recipes/debug.yaml``
with ``--set``-style overrides for the size, shape, precision and ZeRO stage), then
``ncpctl.train.engine.build_engine`` (the loop's own: ``deepspeed_config`` / ``make_optimizer`` /
``lr_schedule`` and ``deepspeed.initialize``) on a world of one (``ncpctl.train.engine.init_distributed``). On a GPU
that is **DeepSpeed bf16** (``train.precision: bf16``; DeepSpeed casts the weights to bf16 and
its ZeRO optimizer keeps the fp32 master weights and Adam state), not ``torch.autocast``.
Random tokens, the same batch every step, one step = ``engine(x, y)`` + ``engine.backward`` +
``engine.step`` with a device synchronize before and after each timed step.

How to read each section (JSON keys in brackets):

1. train step [train_step]: pythia-160m, T=2048, micro batch 8, ZeRO-1 (as
   ``recipes/pythia160m.yaml``), for ``base`` (concept off), ``concept`` (ConceptLM, the
   size's defaults E=1, C=2, k=4, N=64, S=n_heads) and ``pm`` (base + 2 token layers), and
   ``reference``: the base model as a plain PyTorch loop (``ncpctl.profile.reference``: the same
   function and initial weights, autocast bf16, SDPA ``is_causal``, blocks compiled with
   ``reference_compile``, fused AdamW, no DeepSpeed). After ``warmup`` untimed steps the models
   are timed in alternating order for ``rounds`` rounds. ``median_s`` is the step time,
   ``tokens_per_s`` = B*T / median_s, ``mfu`` = exact training FLOPs per step with attention
   counted in full (``exact_flops(cfg, T, B).training_per_step()``) / median_s / ``peak`` (the
   device's dense bf16 peak from ``ncpctl.profile.timing.device_peak``; ``peak_source`` says
   which); ``mfu_causal`` with the causal count. ``ours_over_reference``: paired median of the
   base engine's step time over the reference's (issue 45's goal <= 1.0).
   A well-fed 160M model at T=2048 typically reaches tens of percent; single digits would
   mean something (kernel choice, syncs, the optimizer) is off.
2. SDPA backend [sdpa]: one profiled training step of ``base`` and ``concept``
   (torch.profiler, CPU + CUDA). Kernels launched under the attention ops are classified by
   name (flash / mem_efficient / cudnn / math) into ``backend``; ``backend_from_ops`` is the
   same read from the dispatched ATen op names (``_scaled_dot_product_flash_attention``, ...).
   A fused flash-style kernel is expected (``expected_flash``): the model calls SDPA with
   ``is_causal=True`` and no mask when there is no sliding window. Both PyTorch's flash kernel and
   cuDNN's count: on Hopper PyTorch 2.5+ dispatches to cuDNN's fused attention first (the first
   H200 run, torch 2.11: ``cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_*``), which is
   a flash kernel too; math or mem_efficient would fail the check. ``sdp_flags`` are
   ``torch.backends.cuda.*_sdp_enabled()``.
3. ZeRO [zero]: the ConceptLM pythia-70m at the same T and batch under ZeRO stage 1 and 2,
   ``steps`` steps each on one batch. ``median_s`` excludes the first step; ``peak_bytes`` =
   ``torch.cuda.max_memory_allocated`` over build + steps (``allocated_before_bytes``: what
   was still allocated when that stage started, ``peak_above_before_bytes`` the difference);
   ``optimizer`` is DeepSpeed's wrapper class. On one GPU ZeRO partitions over a world of one,
   so the two stages differ in their gradient buffers only, not by a factor.
   Both stages start from the same weights, so ``first_loss_diff`` must be within
   ``first_loss_tol`` (1e-2 in bf16, 1e-4 in fp32); losses must be finite and fall. In bf16 ZeRO-1
   runs DeepSpeed's ``BF16_Optimizer`` (``ncpctl.train.config.bf16_optimizer``), and
   ``zero1_zero_optimizer`` is stage 1 on the ZeRO optimizer beside it (``deepspeed.extra``
   ``data_types.grad_accum_dtype: bf16``): ``bf16_optimizer_over_zero_optimizer`` is their
   step-time ratio (what skipping the per-tensor overflow pass gives).
4. decode [decode]: run first, in a process of its own (this script with ``--only decode``;
   ``process``): the ConceptLM pythia-160m in bf16 weights, ``torch.no_grad()``, greedy,
   ``prefill`` of 128-token prompts then 256 steps, batch 1 and 8, each twice: the steps generation
   takes on this device (``path``: on a GPU the static step captured as one CUDA graph and replayed,
   ``cuda_graphs.GraphedSteps``; on the CPU that step eagerly) and, under ``eager``, ``decode_step``.
   ``over_eager``: the speed-up; ``eager_reason``: None when the graph ran, else why it fell back;
   ``tokens_same_as_eager``: the share of identical greedy tokens (bf16 near-ties may flip).
   ``tokens_per_s`` = batch * new tokens / decode seconds (prefill timed apart). ``max_abs_diff``
   compares the logits of the last cached step with a full forward of the whole sequence at
   that position (padded-vocab rows excluded); ``ok`` when it is within ``tol_rel`` of the
   largest logit (5e-2 in bf16, 1e-4 in fp32); ``argmax_match``: both pick the same token
   (random weights give near-tied logits, so a bf16 flip there is not a failure).
5. ConceptLM/PM [concept_vs_pm]: ``time_ratio`` = median over rounds of the per-round
   concept/pm step-time ratio (the rounds of section 1, measured back to back), next to
   ``flops_ratio`` (exact causal training FLOPs); ``difference`` = time - FLOPs ratio, judged
   against ``bench/train_step.py``'s goal of 0.02 (``within_goal``). ConceptLM's concept path
   is small, low-arithmetic-intensity work (pooling, T/k-position layers, heads), so on a GPU
   a time ratio above the FLOPs ratio is the expected direction.

6. NCP-ArchPreview [archpreview]: ``recipes/debug-archpreview.yaml``'s design (llama blocks with
   post-norm and layer-wise QK-norm, sliding windows, softmax code weights, Muon on the hidden
   matrices) widened to ``archpreview`` = (d, heads, FFN, E + D layers), T and batch as section 1,
   ZeRO-2, as three engines: ``plain`` (no IRC/CRC/MTP), ``irc_crc`` and ``irc_crc_mtp``, timed
   in alternating order after one warm-up step. ``irc_crc_over_plain`` is the IRC+CRC step-time
   overhead next to ``residual_flops_share`` (bench/train_step.py's goal: <= 1.05; issue 45's <= 1.10);
   ``split`` times forward + backward and ``engine.step`` apart for plain and irc_crc, and
   ``muon_share`` is the optimizer's share of the IRC+CRC step (issue 45's goal <= 10%); NTP losses must be
   finite and fall with Muon bound to the ZeRO-2 partitions (``optimizer``: MuonAdamW inside
   DeepSpeed's wrapper). ``decode``: the irc_crc model's cached decode against a full forward in
   the section's dtype (tolerance as section 4).

7. DLCM [dlcm]: ``attention``: the two token-to-concept attention forms (``profile-kernels``'s
   rows: per_concept's (T, M) mask vs replicated K/V under ``is_causal``) at T 2048 / 8192, d
   1024 / 2048, head dim 128, in the section's dtype: ``faster_form`` and whether the default
   ``concept.cross_attention: per_concept`` (Eq. 14) is it (``configured_is_faster``; the two are
   different functions, a recipe chooses by what it computes; DLCM measured replication 1.26-1.73x
   faster than FlexAttention). ``decode``:
   bench/dlcm_decode.py's DLCM (d 1024, concepts 2048, R = 4, random weights) against its
   layer-matched and token-layer bases, per-token decode time best of 3, batch 1 and 8 (goal:
   DLCM <= 1.2x the matched base). Speed only: not in ``checks``.

8. CDLM [cdlm]: Steerling's Causal Diffusion LM (``model.objective: causal_diffusion``, block
   ``cdlm_block`` = 64, full RoPE) against the AR base at section 1's size, T and batch, ZeRO-1,
   timed alternately: ``cdlm_over_ar`` (bench/cdlm.py's goal <= 1.15: one noisy copy, not two),
   losses finite and falling, and the SDPA backend the boolean block-causal mask dispatches to
   (``cdlm_backend``; flash takes no mask). ``flex``: block-causal attention forward + backward at
   T 2048 / 8192 (B 8, 12 heads of 64) as SDPA with that mask, as FlexAttention with a BlockMask
   (compiled) and as SDPA ``is_causal`` (the floor): ``max_abs_diff`` flex vs mask (``ok`` within
   2e-2 of the output scale in bf16) and ``flex_over_sdpa_mask``, i.e. whether building the
   FlexAttention path (issue 23's open item) pays.

9. real runs [real_runs]: issue 27's features on the device (the comment at section 9 says what
   each number is), each part recorded on its own (``real_runs.errors``; copied into ``errors`` as ``real_runs.<part>``): ``bf16``: the
   ConceptLM at section 3's size trained 16 steps on one stream of 4 batches at ZeRO 0 in fp32 and
   in bf16 (DeepSpeed's stage-0 bf16 wrapper, whose init step ``_undo_init_step`` undoes) from one
   seed, both curves, mean |bf16 - fp32| over the last 5 steps within 0.05 nats (as
   tests/train/test_bf16.py on the CPU) and AdamW's step count = 16; ``documents``: section 1's
   ConceptLM with ``data.document_mask``, packed documents' ``doc_ids`` through the loop's
   ``DocumentHooks``, masked/unmasked step time and dynamo's graph count after each of 5 batches of
   new documents (a FlexAttention ``BlockMask`` per batch on a GPU: no graph after the first);
   ``checkpointing``: none / selective / full on that engine, peak memory of one step above what
   was allocated before it and memory at the forward's end, against ``accounting_memory``'s
   estimate (ratios: information), step time per mode; ``compile``: section 1's base model eager
   vs ``train.compile: true`` (inductor; ``--dry``: backend eager), compile time apart, step-time
   ratio, first-loss difference (tolerance as section 3), graphs made after the warm-up.
   About 60-90 s on an H200 (two inductor compiles: FlexAttention's and the blocks').

10. fused loss [fused_ce]: the LM head's differentiated loss as ncpctl's own fused head and as Liger
   Kernel's fused linear cross-entropy (what ``LMHead`` uses on a GPU when installed) at
   ``fused_ce`` = (tokens, d, V) in the section's dtype: loss and gradient differences (``ok`` within
   ``tol``), median forward + backward time, peak memory above the inputs. ``--dry``: the second is
   ``F.cross_entropy`` of the full logits; a GPU without Liger records ``liger_installed`` False.

goals [goals]: issue 45's table (``GOALS``), each measure's value, goal and whether it is met.

``--profile`` replaces the check by a diagnosis: where the time of section 4's decode step
(batch 1, concept path on and off, and ``concept_graphed``: the CUDA-graph replay generation uses)
and of sections 1 and 6's training steps goes (wall vs
kernel time per call, launches, host syncs, top ops and kernels). The first H200 run measured a
decode step of ~79 ms at batch 1 and an IRC+CRC step 1.58x the plain one; this is how to see why.

``--dry`` runs the same code on the CPU with tiny shapes (``debug`` size, T=64, fp32, one
warm-up step, two rounds, a few decode tokens; ZeRO on DeepSpeed's CPU accelerator) so the
test suite catches breakage; its numbers mean nothing and the backend reads "n/a on CPU".
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ holds tokenize.py: drop this folder from the import path, or `import tokenize`
# (stdlib, used by inspect) would import that script.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

from ncpctl.profile.timing import paired_ratios  # noqa: E402  (no torch at import)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_T_PROCESS = time.perf_counter()  # process_s counts from here (before torch and DeepSpeed are imported)

REPO = _HERE.parent
BASE_RECIPE = REPO / "recipes" / "debug.yaml"
SECTIONS = ("train_step", "sdpa", "zero", "decode", "concept_vs_pm", "archpreview", "dlcm", "cdlm", "real_runs",
            "fused_ce")
# issue 45's goals, judged in ``goals`` from the sections' numbers: (what, section, goal, direction)
GOALS = {"mfu_base": ("pythia-160m bf16 step MFU (full-attention FLOPs)", "train_step", 0.40, ">="),
         "ours_over_reference": ("ours / plain-PyTorch reference step time", "train_step", 1.0, "<="),
         "concept_pm_difference": ("ConceptLM/PM time ratio - FLOPs ratio", "concept_vs_pm", 0.03, "<="),
         "irc_crc_over_plain": ("IRC+CRC / plain step", "archpreview", 1.10, "<="),
         "muon_share": ("optimizer (MuonAdamW) share of the IRC+CRC ArchPreview step", "archpreview", 0.10, "<="),
         "decode_b1_tokens_per_s": ("ConceptLM cached decode, batch 1, tok/s (own process)", "decode", 400.0, ">="),
         "decode_b8_tokens_per_s": ("ConceptLM cached decode, batch 8, tok/s (own process)", "decode", 2500.0, ">=")}
ARCHPREVIEW_RECIPE = REPO / "recipes" / "debug-archpreview.yaml"
DLCM_RECIPE = REPO / "recipes" / "debug-dlcm.yaml"  # section 7's decode models (as bench/dlcm_decode.py)
FLASH_CLASS = ("flash", "cudnn")  # section 2: fused flash-style SDPA kernels (cuDNN's is preferred on Hopper)
CONCEPT_PM_GOAL = 0.02  # section 5: |time ratio - FLOPs ratio|, the goal bench/train_step.py judges too
# section 6's variants of recipes/debug-archpreview.yaml: the same model without the dynamic
# residuals and MTP, with IRC + CRC, and with MTP too (all Muon, post-norm, ZeRO-2)
ARCH_VARIANTS = {"plain": ["model.residual=plain", "model.crc_connections=[]", "model.mtp_depth=null"],
                 "irc_crc": ["model.mtp_depth=null"], "irc_crc_mtp": []}
# variant -> (concept.enabled, extra_token_layers)
VARIANTS = {"base": (False, 0), "concept": (True, 0), "pm": (False, 2)}


@dataclass(frozen=True)
class Shapes:
    """Everything ``--dry`` shrinks."""

    train_size: str
    seq_len: int
    batch: int
    warmup: int
    rounds: int
    zero_size: str
    zero_steps: int
    decode_size: str
    prompt_len: int
    new_tokens: int
    decode_batches: tuple[int, ...]
    archpreview: tuple[int, int, int, int] = (64, 4, 176, 4)  # section 6: d, heads, FFN, layers (E + D)
    archpreview_steps: int = 3
    dlcm_grid: tuple[tuple[int, ...], tuple[int, ...], int] = ((128, 256), (64,), 16)  # section 7: T, d, head dim
    dlcm_decode_d: int = 64  # section 7: the decode benchmark's token width (concepts twice as wide)
    cdlm_block: int = 16  # section 8: the CDLM's block (Steerling: 64)
    cdlm_rounds: int = 2  # section 8: timed rounds per model / attention form
    cdlm_heads: int = 2  # section 8: heads of the FlexAttention vs SDPA comparison (head dim 64)
    cdlm_flex_T: tuple[int, ...] = (64,)  # section 8: sequence lengths of that comparison
    dlcm_new_tokens: int = 8  # section 7: decode steps per timed DLCM run
    reference_compile: str = "eager"  # section 1: torch.compile backend of the plain-PyTorch reference's blocks
    fused_ce: tuple[int, int, int] = (128, 64, 512)  # section 10: tokens N, width d, vocabulary V
    fused_ce_rounds: int = 2  # section 10: timed forward + backward passes per implementation


GPU_SHAPES = Shapes("pythia-160m", 2048, 8, 2, 8, "pythia-70m", 6, "pythia-160m", 128, 256, (1, 8),
                    (1024, 16, 2816, 12), 6, ((2048, 8192), (1024, 2048), 128), 1024, 64, 4, 12, (2048,), 64,
                    "inductor", (16384, 768, 50304), 5)
DRY_SHAPES = Shapes("debug", 64, 2, 1, 2, "debug", 3, "debug", 16, 8, (1, 4), (64, 4, 176, 4), 3)
# sections that build DeepSpeed engines (the decode process of its own imports none)
ENGINE_SECTIONS = {"train_step", "sdpa", "concept_vs_pm", "zero", "archpreview", "cdlm", "real_runs", "profile_train"}


@dataclass
class Env:
    device: Any  # torch.device
    on_gpu: bool
    bf16: bool
    peak: float  # FLOP/s for MFU
    peak_source: str
    dist: Any = None  # ncpctl.train.engine.Dist: the world of one the engines are built on

    def sync(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- engines


def make_recipe(size: str, T: int, B: int, variant: str, zero_stage: int, env: Env, steps: int,
                sets_after: tuple[str, ...] = ()) -> Any:
    """``recipes/debug.yaml`` with ``--set`` overrides (``sets_after`` last): the recipe ``ncpctl pretrain`` would load."""
    from ncpctl.model.core.config import SIZES
    from ncpctl.recipe import load_recipe

    concept, extra = VARIANTS[variant]
    sets = [f"model.size={size}", f"model.max_seq_len={T}", f"tokenizer.vocab_size={SIZES[size]['vocab_size']}",
            f"model.concept.enabled={str(concept).lower()}", f"model.extra_token_layers={extra}",
            f"train.seq_len={T}", f"train.micro_batch_size={B}", f"train.global_batch_size={B}",
            f"train.precision={'bf16' if env.bf16 else 'fp32'}", f"deepspeed.zero_stage={zero_stage}",
            f"train.max_steps={steps}", "train.warmup_steps=0",
            "train.lr=6e-4", "train.min_lr=6e-5", *sets_after]  # Pythia-160m's (recipes/pythia-common.yaml)
    return load_recipe(BASE_RECIPE, sets)


def build_engine(recipe: Any, env: Env, seed: int = 0) -> Any:
    """The DeepSpeed engine as ``ncpctl pretrain`` builds it (``ncpctl.train.engine.build_engine``)."""
    import torch

    from ncpctl.model.core.model import NCPModel
    from ncpctl.train.engine import build_engine as loop_engine

    torch.manual_seed(seed)
    engine, _ = loop_engine(recipe, NCPModel(recipe.model_config), env.dist)
    engine.train()
    return engine


def timed(step: Callable[[], Any], env: Env) -> tuple[float, float]:
    """(seconds, loss) of one step, synchronized on both sides."""
    from ncpctl.profile.timing import timed as timed_call

    dt, loss = timed_call(step, env.device if env.on_gpu else None)
    return dt, float(loss)


def _batch(cfg: Any, B: int, T: int, env: Env) -> tuple[Any, Any]:
    from ncpctl.profile.step import next_token_batch

    x, y = next_token_batch(cfg, B, T)  # (B, T) tokens and next tokens (CPU); the last target is -100
    return x.to(env.device), y.to(env.device)


def release(engine: Any) -> None:
    """DeepSpeed keeps an engine reachable (optimizer hooks) until ``destroy()``: without it
    the weights and optimizer state of every engine built stay allocated."""
    engine.destroy()


def _free(env: Env) -> None:
    gc.collect()
    if env.on_gpu:
        import torch

        torch.cuda.empty_cache()


def _mem(env: Env, what: str) -> int | None:
    if not env.on_gpu:
        return None
    import torch

    return int(getattr(torch.cuda, what)())


# ----------------------------------------------------------------------------- 1 + 5: train step


def train_section(sh: Shapes, env: Env) -> tuple[dict[str, Any], dict[str, Any]]:
    """Base, ConceptLM, PM and the plain-PyTorch reference at one shape, timed in alternating order.
    Returns (result, steps) with the step functions kept for the profiler (section 2)."""
    from ncpctl.model.accounting.flops import FLOP_CONVENTION, exact_flops
    from ncpctl.profile.step import engine_step

    T, B = sh.seq_len, sh.batch
    engines, cfgs = {}, {}
    for name in VARIANTS:
        recipe = make_recipe(sh.train_size, T, B, name, 1, env, sh.warmup + sh.rounds + 2)
        engines[name], cfgs[name] = build_engine(recipe, env), recipe.model_config
    x, y = _batch(cfgs["base"], B, T, env)
    steps = {n: engine_step(e, x, y) for n, e in engines.items()}
    steps["reference"] = reference(cfgs["base"], x, y, sh, env)
    first = {n: [timed(fn, env)[1] for _ in range(sh.warmup)][0] for n, fn in steps.items()}
    secs: dict[str, list[float]] = {n: [] for n in steps}
    losses: dict[str, list[float]] = {n: [] for n in steps}
    for r in range(sh.rounds):
        # alternate who goes first: the first in a round can pay for what the previous one left
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            dt, loss = timed(steps[name], env)
            secs[name].append(dt)
            losses[name].append(loss)
    models: dict[str, Any] = {}
    for name, s in secs.items():
        cfg = cfgs.get(name, cfgs["base"])  # the reference is the base model
        fl = exact_flops(cfg, T, B)
        causal, full = fl.training_per_step(causal=True), fl.training_per_step(causal=False)
        med = statistics.median(s)
        engine = engines.get(name)
        models[name] = {
            "concept_enabled": cfg.concept.enabled, "extra_token_layers": cfg.extra_token_layers,
            "parameters": sum(p.numel() for p in (engine.module if engine else steps[name].model).parameters()),
            "optimizer": type(engine.optimizer).__name__ if engine else "torch AdamW (fused)",
            "median_s": med, "best_s": min(s), "seconds": s, "tokens_per_s": B * T / med,
            "training_flops_full": full, "training_flops_causal": causal,
            # MFU counts attention in full (FLOP_CONVENTION, the training loop's); the causal count apart
            "mfu": full / med / env.peak, "mfu_causal": causal / med / env.peak,
            "first_loss": first[name], "last_loss": losses[name][-1],
            "finite": all(math.isfinite(v) for v in [first[name], *losses[name]]),
        }
    result = {"size": sh.train_size, "seq_len": T, "batch": B, "zero_stage": 1, "warmup": sh.warmup,
              "rounds": sh.rounds, "precision": "bf16 (DeepSpeed)" if env.bf16 else "fp32 (DeepSpeed)",
              "peak": env.peak, "peak_source": env.peak_source, "max_memory_allocated_bytes": _mem(env, "max_memory_allocated"),
              "flops_convention": FLOP_CONVENTION,
              "reference": {"what": "plain PyTorch: RefGPT (ncpctl/profile/reference.py) with the base model's weights, "
                                    f"{'autocast bf16' if env.bf16 else 'fp32'}, SDPA is_causal, blocks compiled "
                                    f"({sh.reference_compile}), fused AdamW, no DeepSpeed",
                            "compile_backend": sh.reference_compile},
              "ours_over_reference": paired_ratios(secs["base"], secs["reference"])["paired_median"],
              "models": models}
    return result, {"steps": steps, "engines": engines}


def reference(cfg: Any, x: Any, y: Any, sh: Shapes, env: Env) -> Callable[[], Any]:
    """Section 1's plain-PyTorch reference step (``ncpctl.profile.reference``) of the base model, with
    the weights a base engine starts from (seed 0) and its lr and clipping; ``.model`` holds the model."""
    import torch

    from ncpctl.model.core.model import NCPModel
    from ncpctl.profile.reference import RefGPT, reference_step

    torch.manual_seed(0)
    model = RefGPT.from_ncp(NCPModel(cfg)).to(env.device).train()
    step = reference_step(model, x, y, lr=6e-4, clip=1.0, bf16=env.bf16, compile_backend=sh.reference_compile)
    step.model = model  # type: ignore[attr-defined]
    return step


def concept_vs_pm(train: dict[str, Any]) -> dict[str, Any]:
    """Section 5 from section 1's rounds: the same comparison as bench/train_step.py."""
    c, p = train["models"]["concept"], train["models"]["pm"]
    ratio = paired_ratios(c["seconds"], p["seconds"])
    time_ratio = ratio["paired_median"]
    flops_ratio = c["training_flops_causal"] / p["training_flops_causal"]
    goal = CONCEPT_PM_GOAL
    return {"size": train["size"], "seq_len": train["seq_len"], "batch": train["batch"],
            "time_ratio": time_ratio, "time_ratio_best_rounds": ratio["best"], "time_ratio_of_medians": ratio["median"],
            "flops_ratio": flops_ratio,
            "flops_ratio_full_attention": c["training_flops_full"] / p["training_flops_full"],
            "difference": time_ratio - flops_ratio, "goal": goal, "within_goal": abs(time_ratio - flops_ratio) <= goal}


# ----------------------------------------------------------------------------- 2: SDPA backend


def kernel_backend(name: str) -> str | None:
    """SDPA backend a CUDA kernel name belongs to (None: not an attention kernel)."""
    n = name.lower()
    if "flex_attention" in n:  # Triton's FlexAttention kernels: "triton_tem_fused_flex_attention_0"
        return "flex"
    if "cudnn" in n:  # before flash: cuDNN's SDPA kernels are named "cudnn_..._sdpa_..._flash_fprop_..."
        return "cudnn"
    if "flash" in n:
        return "flash"
    # mem-efficient kernels are "fmha_cutlassF_..."; cuBLAS's CUTLASS GEMMs say "gemm"
    if any(s in n for s in ("efficient", "mem_eff", "memeff", "fmha")) or ("cutlass" in n and "gemm" not in n):
        return "mem_efficient"
    if any(s in n for s in ("gemm", "bmm", "softmax")):
        return "math"
    return None


def op_backend(names: set[str]) -> str:
    """The backend SDPA dispatched to, read from ATen op names."""
    found = set()
    # "aten::_scaled_dot_product_flash_attention", "ScaledDotProductFlashAttentionBackward0", ...
    for n in (x.lower().replace("_", "") for x in names):
        for key, backend in (("flashattention", "flash"), ("efficientattention", "mem_efficient"),
                             ("cudnnattention", "cudnn"), ("attentionmath", "math")):
            if key in n:
                found.add(backend)
    return "+".join(sorted(found)) or "unknown"


def _verdict(labels: set[str | None]) -> str:
    fused = {x for x in labels if x in ("flash", "cudnn", "mem_efficient")}
    if fused:
        return "+".join(sorted(fused))
    return "math" if "math" in labels else "unknown"


def _is_attention(name: str) -> bool:
    n = name.lower()
    return "scaled_dot_product" in n or "scaleddotproduct" in n or "attention" in n


def profile_attention(step: Callable[[], Any], env: Env) -> dict[str, Any]:
    """Profile one training step; the attention ops and the CUDA kernels launched under them."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.on_gpu else [])
    env.sync()
    with profile(activities=acts) as prof:
        step()
        env.sync()
    events = list(prof.events())
    ops = {e.name for e in events if e.device_type == DeviceType.CPU and _is_attention(e.name)}
    attn_kernels: set[str] = set()
    for e in events:
        if not e.kernels:
            continue
        a = e
        while a is not None and not _is_attention(a.name):
            a = a.cpu_parent
        if a is not None:
            attn_kernels.update(k.name for k in e.kernels)
    all_kernels = {e.name for e in events if e.device_type == DeviceType.CUDA}
    attributed = bool(attn_kernels)
    if not attributed:  # no parent links: fall back to the attention-specific names among all kernels
        attn_kernels = {k for k in all_kernels if kernel_backend(k) in ("flash", "cudnn", "mem_efficient")}
    from_ops = op_backend(ops)
    out: dict[str, Any] = {"attention_ops": sorted(ops), "backend_from_ops": from_ops,
                           "cuda_kernels_total": len(all_kernels), "kernels_attributed_to_ops": attributed,
                           "attention_kernels": sorted(k[:200] for k in attn_kernels)[:24]}
    if env.on_gpu:
        out["backend"] = _verdict({kernel_backend(k) for k in attn_kernels})
        out["consistent"] = out["backend"] == from_ops
    else:
        out["backend"] = "n/a on CPU"
    return out


def sdpa_section(trained: dict[str, Any], env: Env) -> dict[str, Any]:
    import torch

    b = torch.backends.cuda
    flags = {"flash": b.flash_sdp_enabled(), "mem_efficient": b.mem_efficient_sdp_enabled(),
             "math": b.math_sdp_enabled(), "cudnn": b.cudnn_sdp_enabled()}
    models = {n: profile_attention(trained["steps"][n], env) for n in ("base", "concept")}
    out: dict[str, Any] = {"sdp_flags": flags, "models": models}
    if env.on_gpu:
        out["expected_flash"] = all(m["backend"] in FLASH_CLASS for m in models.values())
    return out


# ----------------------------------------------------------------------------- 3: ZeRO-1 / ZeRO-2


def zero_section(sh: Shapes, env: Env) -> dict[str, Any]:
    import torch

    from ncpctl.profile.step import engine_step

    T, B = sh.seq_len, sh.batch
    out: dict[str, Any] = {"size": sh.zero_size, "seq_len": T, "batch": B, "variant": "concept", "steps": sh.zero_steps}
    # zero1: bf16's BF16_Optimizer (ncpctl.train.config.bf16_optimizer); zero1_zero_optimizer: DeepSpeed's
    # ZeRO optimizer at stage 1 (its per-tensor overflow pass), the wrapper bf16 ZeRO-1 ran before issue 45
    runs_of = {"zero1": (1, ()), "zero1_zero_optimizer": (1, ("deepspeed.extra={data_types: {grad_accum_dtype: bf16}}",)),
               "zero2": (2, ())} if env.bf16 else {"zero1": (1, ()), "zero2": (2, ())}
    for key, (stage, extra) in runs_of.items():
        _free(env)
        if env.on_gpu:
            torch.cuda.reset_peak_memory_stats()
        before = _mem(env, "memory_allocated")
        recipe = make_recipe(sh.zero_size, T, B, "concept", stage, env, sh.zero_steps, extra)
        engine = build_engine(recipe, env)
        built = _mem(env, "memory_allocated")
        x, y = _batch(recipe.model_config, B, T, env)
        step = engine_step(engine, x, y)
        runs = [timed(step, env) for _ in range(sh.zero_steps)]
        losses = [loss for _, loss in runs]
        out[key] = {
            "optimizer": type(engine.optimizer).__name__, "stage": engine.zero_optimization_stage(),
            "losses": losses, "first_loss": losses[0],
            "median_s": statistics.median(dt for dt, _ in runs[1:]), "first_step_s": runs[0][0],
            "finite": all(math.isfinite(v) for v in losses), "decreased": losses[-1] < losses[0],
            "allocated_before_bytes": before, "allocated_after_build_bytes": built,
            "peak_bytes": _mem(env, "max_memory_allocated"),
        }
        q = out[key]
        q["peak_above_before_bytes"] = None if before is None else q["peak_bytes"] - before
        release(engine)
        del engine, step, x, y
    z1, z2 = out["zero1"], out["zero2"]
    if "zero1_zero_optimizer" in out:  # the step-time effect of the wrapper (the same first loss: one forward)
        out["bf16_optimizer_over_zero_optimizer"] = z1["median_s"] / out["zero1_zero_optimizer"]["median_s"]
    out["first_loss_diff"] = abs(z1["first_loss"] - z2["first_loss"])
    out["first_loss_tol"] = 1e-2 if env.bf16 else 1e-4
    out["first_loss_match"] = out["first_loss_diff"] <= out["first_loss_tol"]
    out["ok"] = out["first_loss_match"] and all(z[k] for z in (z1, z2) for k in ("finite", "decreased"))
    _free(env)
    return out


# ----------------------------------------------------------------------------- 4: cached decode


def _greedy(model: Any, prompts: Any, n_new: int, vocab: int, env: Env, static: bool = False) -> dict[str, Any]:
    """prefill + n_new decode steps, greedy over the real vocabulary; tokens and timings. ``static``:
    the steps generation takes on CUDA (``cuda_graphs.GraphedSteps``: the static step, captured at
    the second step and replayed); on the CPU the same static step eagerly (``StaticDecoder``)."""
    import torch

    from ncpctl.inference.cuda_graphs import GraphedSteps
    from ncpctl.model.core.decode_static import StaticDecoder

    B, Tp = prompts.shape
    env.sync()
    t0 = time.perf_counter()
    logits, state = model.prefill(prompts, [Tp] * B, max_len=Tp + n_new)  # (B, Tp, V)
    stepper: Any = None
    if static:
        stepper = GraphedSteps(model, state) if env.on_gpu else StaticDecoder(model, state)
    step = stepper.step if stepper is not None else (lambda t: model.decode_step(state, t))
    env.sync()
    t1 = time.perf_counter()
    nxt = logits[:, -1, :vocab].argmax(-1)  # (B,)
    new, last = [], None
    for _ in range(n_new):
        new.append(nxt)
        last = step(nxt)  # (B, V): logits after feeding nxt
        nxt = last[:, :vocab].argmax(-1)
    env.sync()
    t2 = time.perf_counter()
    return {"tokens": torch.stack(new, 1), "last": last, "prefill_s": t1 - t0, "decode_s": t2 - t1,
            "eager_reason": getattr(stepper, "eager_reason", None)}


def _decode_run(model: Any, prompts: Any, sh: Shapes, env: Env, static: bool, tol_rel: float) -> dict[str, Any]:
    """One timed greedy run (after a short warm-up run) and its last logits against the full forward."""
    import torch

    V, B = model.cfg.vocab_size, prompts.shape[0]
    _greedy(model, prompts, min(8, sh.new_tokens), V, env, static)  # warm-up: kernels, allocator, the capture
    r = _greedy(model, prompts, sh.new_tokens, V, env, static)
    seq = torch.cat([prompts, r["tokens"]], 1)  # (B, Tp + n_new): everything fed
    full = model(seq).logits[:, -1, :V].float()  # (B, V) full forward at the last position
    cached = r["last"][:, :V].float()
    diff, scale = (full - cached).abs().max().item(), full.abs().max().item()
    return {"tokens_per_s": B * sh.new_tokens / r["decode_s"], "decode_s": r["decode_s"],
            "prefill_s": r["prefill_s"], "max_abs_diff": diff, "logit_scale": scale,
            "ok": diff <= tol_rel * max(scale, 1.0), "argmax_match": bool((full.argmax(-1) == cached.argmax(-1)).all()),
            "eager_reason": r["eager_reason"], "tokens": r["tokens"]}


def decode_section(sh: Shapes, env: Env) -> dict[str, Any]:
    """Section 4 in this process: each batch decoded the way generation decodes on this device
    (``static``: CUDA graphs of the static step on a GPU, that step eagerly on the CPU) and the
    eager ``decode_step`` beside it, both against the full forward."""
    import torch

    from ncpctl.model.core.config import build_config
    from ncpctl.model.core.model import NCPModel

    cfg = build_config(sh.decode_size, concept=dict(enabled=True))
    dtype = torch.bfloat16 if env.bf16 else torch.float32
    torch.manual_seed(0)
    model = NCPModel(cfg).to(env.device, dtype=dtype).eval()
    V, tol_rel = cfg.vocab_size, (5e-2 if env.bf16 else 1e-4)
    out: dict[str, Any] = {"size": sh.decode_size, "dtype": str(dtype).removeprefix("torch."),
                           "prompt_len": sh.prompt_len, "new_tokens": sh.new_tokens, "tol_rel": tol_rel,
                           "path": "CUDA graph of the static step" if env.on_gpu else "static step, eager (no CUDA)",
                           "batches": {}}
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for B in sh.decode_batches:
            prompts = torch.randint(0, V, (B, sh.prompt_len), generator=g).to(env.device)
            eager = _decode_run(model, prompts, sh, env, False, tol_rel)
            static = _decode_run(model, prompts, sh, env, True, tol_rel)
            same = (eager.pop("tokens") == static.pop("tokens")).float().mean().item()
            eager.pop("eager_reason")
            out["batches"][str(B)] = {**static, "eager": eager, "over_eager": static["tokens_per_s"] / eager["tokens_per_s"],
                                      "tokens_same_as_eager": same}
    out["ok"] = all(b["ok"] and b["eager"]["ok"] and b["eager_reason"] is None for b in out["batches"].values())
    del model
    _free(env)
    return out


def decode_own_process(args: argparse.Namespace) -> dict[str, Any]:
    """Section 4 in a process of its own (issue 45's goal is measured so: inside the full check the
    first H200 run decoded at half the speed of a process of its own): this script with ``--only
    decode``, its JSON read back; the child's section time and errors come along."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "decode.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--only", "decode", "--json", str(path),
               "--precision", args.precision, *(["--dry"] if args.dry else [])]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if not path.is_file():
            raise RuntimeError(f"the decode process wrote no JSON (exit {proc.returncode}): {proc.stderr[-1500:]}")
        child = json.loads(path.read_text())
    if "decode" not in child:
        raise RuntimeError(f"the decode process failed: {json.dumps(child.get('errors'))[:1500]}")
    return {**child["decode"], "process": {"own": True, "seconds": round(time.perf_counter() - t0, 2),
                                           "section_s": child["section_s"].get("decode")}}


# ----------------------------------------------------------------------------- 7: DLCM


def dlcm_section(sh: Shapes, env: Env) -> dict[str, Any]:
    """DLCM's two attention forms on this device (what the default per_concept costs against
    replicated) and its cached decode cost against the layer-matched and the token-layer base
    (bench/dlcm_decode.py's models, in the section's dtype)."""
    import torch

    from ncpctl.model.core.config import ConceptConfig
    from ncpctl.profile.dlcm import models as dlcm_models
    from ncpctl.profile.dlcm import tokens_per_concept
    from ncpctl.profile.kernels import dlcm_rows, dlcm_speedup, faster_form

    dtype = torch.bfloat16 if env.bf16 else torch.float32
    seq, hidden, hd = sh.dlcm_grid
    speed = dlcm_speedup(dlcm_rows({"seq_len": list(seq), "hidden": list(hidden), "head_dim": hd}, 4, env.device,
                                   dtype, warmup=2, repeats=5))
    out: dict[str, Any] = {"attention": {"dtype": str(dtype).removeprefix("torch."), "grid": speed,
                                         **faster_form(speed, ConceptConfig().cross_attention)}}
    bases, dlcm, cfg = dlcm_models(DLCM_RECIPE, sh.dlcm_decode_d)
    models = {"dlcm": dlcm, **{f"base_{k}": m for k, m in bases.items()}}
    for m in models.values():
        m.to(env.device, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    batches: dict[str, Any] = {}
    with torch.no_grad():
        for B in sh.decode_batches:
            prompts = torch.randint(0, cfg.vocab_size, (B, sh.prompt_len), generator=g).to(env.device)
            best = {k: float("inf") for k in models}
            for _ in range(2):
                for k, m in models.items():
                    r = _greedy(m, prompts, sh.dlcm_new_tokens, cfg.vocab_size, env)
                    best[k] = min(best[k], r["decode_s"] / sh.dlcm_new_tokens)
            batches[str(B)] = {**{f"{k}_ms": v * 1e3 for k, v in best.items()},
                               "ratio_matched": best["dlcm"] / best["base_matched"],
                               "ratio_token": best["dlcm"] / best["base_token"]}
    out["decode"] = {"d_model": sh.dlcm_decode_d, "d_concept": cfg.concept.d_concept, "batches": batches,
                     "boundary_threshold": dlcm.concept.segmenter.threshold,  # calibrated for R = 4 (dlcm_decode)
                     "tokens_per_concept": tokens_per_concept(dlcm, 2, 256), "goal": "<= 1.2 (ratio_matched)"}
    del models, dlcm, bases
    _free(env)
    return out


# ----------------------------------------------------------------------------- 6: NCP-ArchPreview


def _arch_recipe(sh: Shapes, variant: str, env: Env) -> Any:
    from ncpctl.recipe import load_recipe

    d, heads, ffn, layers = sh.archpreview
    T, B = sh.seq_len, sh.batch
    sets = [f"model.d_model={d}", f"model.n_heads={heads}", f"model.n_kv_heads={heads}", f"model.ffn_dim={ffn}",
            f"model.n_layers={layers}", f"model.concept.encoder_layers={layers // 2}", f"model.max_seq_len={T}",
            f"train.seq_len={T}", f"train.micro_batch_size={B}", f"train.global_batch_size={B}",
            f"train.precision={'bf16' if env.bf16 else 'fp32'}", "deepspeed.zero_stage=2",
            f"train.max_steps={sh.archpreview_steps + 2}", "train.warmup_steps=0", *ARCH_VARIANTS[variant]]
    return load_recipe(ARCHPREVIEW_RECIPE, sets, need_sources=False)


def archpreview_section(sh: Shapes, env: Env) -> dict[str, Any]:
    import torch

    from ncpctl.model.accounting.flops import exact_flops
    from ncpctl.profile.step import engine_step

    T, B = sh.seq_len, sh.batch
    engines, cfgs = {}, {}
    for name in ARCH_VARIANTS:
        recipe = _arch_recipe(sh, name, env)
        engines[name], cfgs[name] = build_engine(recipe, env), recipe.model_config
    x, y = _batch(cfgs["plain"], B, T, env)
    # the NTP loss is judged: the NCP term (summed over d, Eq. 22) follows the concepts' scale as they move
    steps = {n: engine_step(e, x, y, "ntp_loss") for n, e in engines.items()}
    first = {n: timed(fn, env)[1] for n, fn in steps.items()}
    secs: dict[str, list[float]] = {n: [] for n in steps}
    losses: dict[str, list[float]] = {n: [first[n]] for n in steps}
    for r in range(sh.archpreview_steps):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            dt, loss = timed(steps[name], env)
            secs[name].append(dt)
            losses[name].append(loss)
    models = {n: {"median_s": statistics.median(secs[n]), "seconds": secs[n], "losses": losses[n],
                  "finite": all(math.isfinite(v) for v in losses[n]), "decreased": losses[n][-1] < losses[n][0],
                  "optimizer": f"{type(getattr(engines[n].optimizer, 'optimizer', engines[n].optimizer)).__name__} in "
                               f"{type(engines[n].optimizer).__name__}"}
              for n in steps}
    for n in ("plain", "irc_crc"):  # where the step's time goes: the optimizer (Muon's Newton-Schulz) apart
        models[n]["split"] = split_step(engines[n], x, y, env, 2)
    ratio = paired_ratios(secs["irc_crc"], secs["plain"])
    out: dict[str, Any] = {"shape": dict(zip(("d_model", "n_heads", "ffn_dim", "n_layers"), sh.archpreview)),
                           "seq_len": T, "batch": B, "zero_stage": 2, "models": models,
                           "irc_crc_over_plain": ratio["paired_median"],
                           "residual_flops_share": exact_flops(cfgs["irc_crc"], T, B).residual_share,
                           "mtp_over_irc_crc": paired_ratios(secs["irc_crc_mtp"], secs["irc_crc"])["paired_median"],
                           "muon_share": models["irc_crc"]["split"]["optimizer_share"]}
    model = engines["irc_crc"].module.eval()
    V, tol_rel = cfgs["irc_crc"].vocab_size, (5e-2 if env.bf16 else 1e-4)
    with torch.no_grad():
        prompts = x[:1, : min(sh.prompt_len, T // 2)]
        r = _greedy(model, prompts, min(sh.new_tokens, T // 2), V, env)
        full = model(torch.cat([prompts, r["tokens"]], 1)).logits[:, -1, :V].float()
        cached = r["last"][:, :V].float()
        diff, scale = (full - cached).abs().max().item(), full.abs().max().item()
    out["decode"] = {"max_abs_diff": diff, "logit_scale": scale, "ok": diff <= tol_rel * max(scale, 1.0)}
    out["ok"] = out["decode"]["ok"] and all(m["finite"] and m["decreased"] for m in models.values())
    for engine in engines.values():
        release(engine)
    _free(env)
    return out


def split_step(engine: Any, x: Any, y: Any, env: Env, n: int) -> dict[str, Any]:
    """``n`` steps of ``engine`` timed in two parts, synchronised between them: forward + backward
    (with ZeRO's gradient reduction) and ``engine.step`` (the optimizer: Muon's Newton-Schulz, AdamW,
    the masters' copy back); medians and the optimizer's share of their sum."""
    fb, opt = [], []
    for _ in range(n):
        env.sync()
        t0 = time.perf_counter()
        engine.backward(engine(x, y).loss)
        env.sync()
        t1 = time.perf_counter()
        engine.step()
        env.sync()
        fb.append(t1 - t0)
        opt.append(time.perf_counter() - t1)
    f, o = statistics.median(fb), statistics.median(opt)
    return {"forward_backward_s": f, "optimizer_s": o, "optimizer_share": o / (f + o)}


# ----------------------------------------------------------------------------- 8: CDLM


def flex_vs_sdpa(T: int, block: int, sh: Shapes, env: Env) -> dict[str, Any]:
    """BlockCausal(block) attention, forward + backward, three ways on one (B, H, T, hd) input:
    SDPA with the boolean mask (``BlockCausal.mask``: the model's path without FlexAttention), FlexAttention
    with a BlockMask (compiled on a GPU; eager on the CPU), and SDPA ``is_causal`` (flash on a
    GPU) as the floor a fused block-causal kernel could reach. ``max_abs_diff``: flex vs the
    masked SDPA's output. On the CPU (``--dry``) forward only: FlexAttention has no CPU backward."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ncpctl.model.core.patterns import BlockCausal

    dtype = torch.bfloat16 if env.bf16 else torch.float32
    B, H, hd = sh.batch, sh.cdlm_heads, 64
    g = torch.Generator(device=env.device).manual_seed(0)
    q, k, v = (torch.randn(B, H, T, hd, device=env.device, dtype=dtype, generator=g).requires_grad_(env.on_gpu)
               for _ in range(3))
    grad = torch.randn(B, H, T, hd, device=env.device, dtype=dtype, generator=g)
    pos = torch.arange(T, device=env.device)[None]
    mask = BlockCausal(block).mask(pos, pos)  # (1, 1, T, T) bool: the mask SDPA gets without FlexAttention

    def visible(b, h, qi, ki):
        return qi // block >= ki // block

    bm = create_block_mask(visible, None, None, T, T, device=str(env.device))
    flex = torch.compile(flex_attention, dynamic=False) if env.on_gpu else flex_attention
    forms = {"sdpa_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
             "flex": lambda: flex(q, k, v, block_mask=bm),
             "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    with torch.no_grad():
        ref, fx = forms["sdpa_mask"]().float(), forms["flex"]().float()
    out: dict[str, Any] = {"T": T, "block": block, "batch": B, "heads": H, "head_dim": hd, "dtype": str(dtype),
                           "timed": "forward + backward" if env.on_gpu else "forward",
                           "max_abs_diff": float((ref - fx).abs().max()), "scale": float(ref.abs().max())}

    def step(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            o = fn()
            if env.on_gpu:
                o.backward(grad)
                q.grad = k.grad = v.grad = None
            return o.detach().float().sum()

        return run

    steps = {n: step(fn) for n, fn in forms.items()}
    for fn in steps.values():  # warm-up (flex compiles here on a GPU)
        fn()
    secs: dict[str, list[float]] = {n: [] for n in steps}
    for r in range(sh.cdlm_rounds):
        for n in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            secs[n].append(timed(steps[n], env)[0])
    med = {n: statistics.median(s) for n, s in secs.items()}
    out["median_ms"] = {n: 1e3 * m for n, m in med.items()}
    out["flex_over_sdpa_mask"] = paired_ratios(secs["flex"], secs["sdpa_mask"])["paired_median"]
    out["flex_over_causal"] = paired_ratios(secs["flex"], secs["sdpa_causal"])["paired_median"]
    out["ok"] = out["max_abs_diff"] <= (2e-2 if env.bf16 else 1e-4) * max(1.0, out["scale"])
    return out


def flex_model_parity(model: Any, x: Any, env: Env) -> dict[str, Any]:
    """The CDLM's eval forward with its block-causal layers on FlexAttention (``patterns.flex_enabled``:
    on a GPU) against the same forward on SDPA with the boolean mask: logits within the section's
    tolerance. On the CPU both are the boolean path (``uses_flex`` False)."""
    import torch

    from ncpctl.model.core import patterns
    was = model.training
    model.eval()
    with torch.no_grad():
        flex = model(x).logits.float()
        real = patterns.flex_enabled
        patterns.flex_enabled = lambda device: False
        try:
            ref = model(x).logits.float()
        finally:
            patterns.flex_enabled = real
    model.train(was)
    diff, scale = float((flex - ref).abs().max()), float(ref.abs().max())
    return {"uses_flex": patterns.flex_enabled(x.device), "max_abs_diff": diff, "logit_scale": scale,
            "ok": diff <= (5e-2 if env.bf16 else 1e-4) * max(scale, 1.0)}


def cdlm_section(sh: Shapes, env: Env) -> dict[str, Any]:
    """Steerling's Causal Diffusion LM (issue 23) on the device: its DeepSpeed training step
    against the AR base of section 1's shape (one noisy copy: goal <= 1.15, bench/cdlm.py's),
    the SDPA backend its boolean block-causal mask dispatches to, and FlexAttention with a
    BlockMask against that masked SDPA (whether the fused path is worth building)."""
    import torch

    from ncpctl.profile.step import engine_step, random_windows

    T, B = sh.seq_len, sh.batch
    cd = ("model.objective=causal_diffusion", f"model.diffusion.block_size={sh.cdlm_block}", "model.rotary_pct=1.0")
    engines = {n: build_engine(make_recipe(sh.train_size, T, B, "base", 1, env, sh.cdlm_rounds + 4, extra), env)
               for n, extra in (("ar", ()), ("cdlm", cd))}
    cfg = engines["ar"].module.cfg
    (w,) = random_windows(cfg.vocab_size - 2, B, T)
    w = w + 2  # no EOD or [MASK] among the data tokens
    xn, yn = engines["cdlm"].module.objective.keyed_batch(w, torch.arange(B))
    data = {"ar": (w[:, :-1], w[:, 1:]), "cdlm": (xn, yn)}
    steps = {n: engine_step(e, *(t.to(env.device) for t in data[n])) for n, e in engines.items()}
    first = {n: timed(fn, env)[1] for n, fn in steps.items()}
    secs: dict[str, list[float]] = {n: [] for n in steps}
    losses: dict[str, list[float]] = {n: [] for n in steps}
    for r in range(sh.cdlm_rounds):
        for n in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            dt, loss = timed(steps[n], env)
            secs[n].append(dt)
            losses[n].append(loss)
    backend = profile_attention(steps["cdlm"], env)
    parity = flex_model_parity(engines["cdlm"].module, data["cdlm"][0][:2].to(env.device), env)
    out: dict[str, Any] = {
        "size": sh.train_size, "seq_len": T, "batch": B, "block": sh.cdlm_block, "rounds": sh.cdlm_rounds,
        "median_ms": {n: 1e3 * statistics.median(s) for n, s in secs.items()},
        "cdlm_over_ar": paired_ratios(secs["cdlm"], secs["ar"])["paired_median"], "goal": 1.15,
        "losses": {n: [first[n], *losses[n]] for n in steps},
        "cdlm_backend": backend.get("backend"), "cdlm_backend_from_ops": backend["backend_from_ops"],
        "cdlm_attention_kernels": backend["attention_kernels"][:6], "model_flex": parity,
    }
    out["finite"] = all(math.isfinite(v) for ls in out["losses"].values() for v in ls)
    out["decreased"] = all(ls[-1] < ls[0] for ls in out["losses"].values())
    for e in engines.values():
        release(e)
    engines.clear()
    _free(env)
    out["flex"] = [flex_vs_sdpa(t, sh.cdlm_block, sh, env) for t in sh.cdlm_flex_T]
    out["ok"] = out["finite"] and out["decreased"] and parity["ok"] and all(f["ok"] for f in out["flex"])
    return out


# ----------------------------------------------------------------------------- 10: fused LM head + loss


def fused_ce_section(sh: Shapes, env: Env) -> dict[str, Any]:
    """The LM head's differentiated loss two ways on one (N, d) x (V, d) problem in the section's dtype:
    ncpctl's own (``LMHead``'s ``_HeadLoss``, what the CPU runs) and Liger Kernel's fused linear
    cross-entropy (what ``LMHead`` takes on a GPU when installed; ``head.liger_loss``). The loss and
    both gradients compared (``ok``: within 1e-2 of the loss and of each gradient's largest entry in
    bf16, 1e-5 in fp32), then forward + backward timed alternately and each one's peak memory above
    its inputs. Without CUDA (``--dry``) the second is ``F.cross_entropy`` of the full logits (the code
    path, not Liger); on a GPU without Liger the section says so and compares nothing."""
    import torch
    import torch.nn.functional as F

    from ncpctl.model.core import head as head_mod
    N, d, V = sh.fused_ce
    dtype = torch.bfloat16 if env.bf16 else torch.float32
    liger = head_mod.liger_loss()
    out: dict[str, Any] = {"tokens": N, "d_model": d, "vocab": V, "dtype": str(dtype).removeprefix("torch."),
                           "liger_installed": liger is not None}
    if env.on_gpu and liger is None:
        out["other"] = "none: liger-kernel is not installed (carry its wheel, docs/gpu/README.md)"
        return out
    g = torch.Generator(device=env.device).manual_seed(0)
    h = (torch.randn(N, d, device=env.device, generator=g) / 2).to(dtype)
    w = (torch.randn(V, d, device=env.device, generator=g) / d ** 0.5).to(dtype)
    t = torch.randint(0, V, (N,), device=env.device, generator=g)
    t[::97] = -100  # a few ignored targets, as the last position of every window
    lm = head_mod.LMHead(d, V).to(env.device, dtype)
    lm.weight.data.copy_(w)
    other: Callable[[Any, Any, Any], Any] = (
        (lambda hh, ww, tt: liger(hh, ww, tt, ignore_index=-100, accum_dtype=torch.float32)) if env.on_gpu
        else (lambda hh, ww, tt: F.cross_entropy((hh @ ww.t()).float(), tt, ignore_index=-100)))
    out["other"] = "Liger Kernel liger_fused_linear_cross_entropy" if env.on_gpu else "F.cross_entropy (no Liger on the CPU)"

    def ours() -> tuple[Any, Any, Any]:
        hh = h.detach().requires_grad_()
        lm.weight.grad = None
        loss = head_mod._HeadLoss.apply(hh, lm.weight, t, lm)
        loss.backward()
        return loss.detach(), hh.grad, lm.weight.grad

    def theirs() -> tuple[Any, Any, Any]:
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        loss = other(hh, ww, t)
        loss.backward()
        return loss.detach(), hh.grad, ww.grad

    runs = {"ours": ours, "other": theirs}
    res = {k: fn() for k, fn in runs.items()}  # warm-up (Triton compiles) and the values compared
    tol = 1e-2 if env.bf16 else 1e-5
    (la, ha, wa), (lb, hb, wb) = res["ours"], res["other"]
    out["loss"] = {"ours": float(la), "other": float(lb)}
    out["loss_diff"] = abs(float(la) - float(lb))
    out["grad_h_diff"] = float((ha.float() - hb.float()).abs().max() / hb.float().abs().max())
    out["grad_w_diff"] = float((wa.float() - wb.float()).abs().max() / wb.float().abs().max())
    out["tol"] = tol
    out["ok"] = out["loss_diff"] <= tol * max(1.0, abs(float(lb))) and out["grad_h_diff"] <= tol and out["grad_w_diff"] <= tol
    del res
    secs: dict[str, list[float]] = {k: [] for k in runs}
    peak: dict[str, Any] = {}
    for r in range(sh.fused_ce_rounds):
        for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            _free(env)
            if env.on_gpu:
                torch.cuda.reset_peak_memory_stats()
            before = _mem(env, "memory_allocated")
            secs[k].append(timed(lambda: runs[k]()[0], env)[0])
            peak[k] = None if before is None else _mem(env, "max_memory_allocated") - before
    out["median_ms"] = {k: 1e3 * statistics.median(v) for k, v in secs.items()}
    out["peak_above_inputs_bytes"] = peak
    out["other_over_ours"] = paired_ratios(secs["other"], secs["ours"])["paired_median"]
    return out


# ----------------------------------------------------------------------------- 9: real runs


# Section 9 of ``bench/gpu_check.py`` [real_runs]: what issue 27's features (bf16 at ZeRO 0,
# ``data.document_mask``, ``train.activation_checkpointing``, ``train.compile``) do on the device,
# trained through the same DeepSpeed engines as sections 1-8 (``gpu_check``'s ``make_recipe``,
# ``build_engine``, ``timed``, ``_batch``, ``_mem``, ``release``, ``_free``: the caller passes
# its module as ``h``). Four parts, each recorded on its own (a part that fails is written under
# ``errors`` with its traceback and the others still run):
#
# a. ``bf16``: the ConceptLM at section 3's size, ZeRO stage 0, ``steps`` steps on one stream of
#    ``batches`` random batches (cycled), once in fp32 and once in bf16 from the same seed (bf16 at
#    stage 0 is DeepSpeed's ``FP16_UnfusedOptimizer``, whose init step ``engine._undo_init_step``
#    takes back). Both loss curves; ``mean_abs_diff_last``: mean |bf16 - fp32| over the last
#    ``last`` steps, judged within 0.05 nats (tests/train/test_bf16.py's bound on the CPU);
#    ``adam_steps``: the inner AdamW's step count after the run (= steps: no hidden step). ``--dry``
#    runs the bf16 arm in bf16 on the CPU too (DeepSpeed's same stage-0 wrapper, as the test does).
# b. ``documents``: the ConceptLM at section 1's size, T and batch, ZeRO-1, with
#    ``data.document_mask`` on: each batch packs random-length documents and its ``doc_ids`` reach
#    ``engine(x, y, doc_ids=...)`` through the loop's own hooks (``Hooks.inputs`` ->
#    ``DocumentHooks``, from the loader's ``last_documents``). A masked and an unmasked step per
#    batch, alternating; the first masked step (FlexAttention compiles there on a GPU) is timed
#    apart. ``masked_over_unmasked``: paired median step-time ratio. ``graphs``: dynamo's
#    ``unique_graphs`` (and frames compiled) after each masked batch, counted from before the
#    first: a new document layout is a new ``BlockMask`` (``patterns.document_masks``) that the
#    compiled ``flex_attention`` must take as an input; ``no_recompile``: no graph after the first
#    batch. ``mask_build_ms``: building one batch's token masks alone. ``flex``: whether the token
#    layers ran FlexAttention (False on a GPU: it failed and was switched off for the process,
#    ``flex_off`` says why). On the CPU the masks are boolean (no FlexAttention, no graphs: the
#    check holds trivially there).
# c. ``checkpointing``: the same engine with ``none`` / ``selective`` / ``full``
#    (``ncpctl.train.recompute.apply_activation_checkpointing``, what ``train.activation_checkpointing``
#    applies in ``build_engine``). Per mode one step from a freed allocator:
#    ``peak_above_bytes`` = ``torch.cuda.max_memory_allocated`` over the step minus what was
#    allocated before it (activations + gradient buffers + the optimizer's transients) and
#    ``forward_end_bytes`` = allocated after the forward minus before (what the forward saved, and
#    the loss), next to ``ncpctl.model.accounting.memory.activation_memory`` for the same config,
#    T, batch and precision (flash SDPA): ``estimate_total_bytes`` / ``estimate_saved_bytes`` and
#    the ratios measured / estimate (information, no check; None on the CPU). Then ``rounds``
#    timed steps per mode, alternating: ``median_s``, ``over_none``.
# d. ``compile``: the base model at section 1's size, T and batch, ZeRO-1, eager and with
#    ``train.compile: true`` (``ncpctl.train.compiled``: each block compiled in place), same seed
#    and batch. ``first_loss_diff`` (tolerance as section 3), the compiled engine's first
#    ``warmup`` steps (``compile_s``: their time beyond as many compiled steps), then ``rounds``
#    timed steps each, alternating: ``compiled_over_eager``; ``graphs``: dynamo graphs made during
#    the warm-up and after it (0: nothing recompiles once warm). ``--dry`` compiles with backend
#    ``eager`` (dynamo traces the blocks as on a GPU and runs the graphs without inductor; inductor's
#    CPU compile took ~20 s on 2 cores, most of the dry run): ``backend`` says which.
#
# Checks (into ``gpu_check``'s ``checks``): ``bf16_tracks_fp32_zero0`` (a), ``documents_no_recompile``
# (b), ``compile_first_loss_matches_eager`` (d).

BF16_TOL = 0.05  # nats: tests/train/test_bf16.py's bound, fp32 vs bf16 on the CPU
CKPT_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class RunShapes:
    """Section 9's own counts (sizes, T and batch come from gpu_check's ``Shapes``)."""

    bf16_steps: int  # a: steps per precision
    bf16_batches: int  # a: distinct batches, cycled
    bf16_last: int  # a: the last steps compared
    doc_batches: int  # b: batches of different documents (the first compiles)
    doc_lengths: tuple[int, int]  # b: document lengths, uniform in [lo, hi]
    ckpt_rounds: int  # c: timed steps per mode
    compile_warmup: int  # d: compiled steps before timing
    compile_rounds: int  # d: timed steps per engine
    compile_backend: str  # d: torch.compile backend


GPU_RUNS = RunShapes(16, 4, 5, 5, (64, 1024), 2, 2, 3, "inductor")
DRY_RUNS = RunShapes(8, 4, 3, 3, (4, 32), 2, 1, 2, "eager")


def real_runs(sh: Any, env: Any, dry: bool,
              progress: Callable[[dict[str, Any]], None] = lambda out: None) -> dict[str, Any]:
    """Section 9: parts a-d (the comment above); ``sh`` is Shapes;
    ``progress`` gets the result so far after each part (gpu_check rewrites its JSON)."""
    rs = DRY_RUNS if dry else GPU_RUNS
    out: dict[str, Any] = {"shapes": dict(vars(rs)), "errors": {}, "part_s": {}}

    def part(name: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            out[name] = fn()
        except Exception as e:  # one failing part must not cost the others' numbers
            out["errors"][name] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-6000:]}
        finally:
            _free_runs(env)
            out["part_s"][name] = round(time.perf_counter() - t0, 2)
            progress(out)

    part("bf16", lambda: bf16_vs_fp32(sh, rs, env))
    held: dict[str, Any] = {}

    def build() -> dict[str, Any]:
        recipe = make_recipe(sh.train_size, sh.seq_len, sh.batch, "concept", 1, env,
                               4 * rs.doc_batches + 4 * rs.ckpt_rounds + 8, ("data.document_mask=true",))
        held.update(recipe=recipe, engine=build_engine(recipe, env))
        return {"size": sh.train_size, "variant": "concept", "zero_stage": 1}

    part("concept_engine", build)
    try:
        for name, fn in (("documents", documents_part), ("checkpointing", checkpointing_part)):
            if "engine" in held:
                part(name, lambda: fn(held["engine"], held["recipe"], sh, rs, env))
            else:
                out["errors"][name] = {"error": "needs the ConceptLM engine, which failed to build", "traceback": ""}
    finally:
        if "engine" in held:
            release(held.pop("engine"))
        _free_runs(env)
    part("compile", lambda: compile_part(sh, rs, env))
    return out


def _free_runs(env: Any) -> None:
    """gpu_check's ``_free`` (garbage collection, the CUDA cache emptied) on a GPU only: on the CPU
    nothing reads the allocator, and each collection of this process costs ~0.2 s."""
    if env.on_gpu:
        _free(env)


def runs_checks(r: dict[str, Any]) -> dict[str, bool]:
    """Section 9's correctness verdicts, for the parts that ran."""
    out: dict[str, bool] = {}
    if "bf16" in r:
        out["bf16_tracks_fp32_zero0"] = r["bf16"]["ok"]
    if "documents" in r:
        out["documents_no_recompile"] = r["documents"]["no_recompile"] and r["documents"]["finite"]
    if "compile" in r:
        out["compile_first_loss_matches_eager"] = r["compile"]["first_loss_match"]
    return out


def _adam_steps(engine: Any) -> float | None:
    """The inner optimizer's step count (AdamW's bias-correction step), or None without state."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = [float(s["step"]) for s in inner.state.values() if "step" in s]
    return max(steps) if steps else None


def bf16_vs_fp32(sh: Any, rs: RunShapes, env: Any) -> dict[str, Any]:
    """Part a: the same stream of batches in fp32 and in bf16 at ZeRO 0 from one seed."""
    from ncpctl.profile.step import engine_step, random_windows

    T, B, n = sh.seq_len, sh.batch, rs.bf16_steps
    runs: dict[str, Any] = {}
    windows = None
    for precision in ("fp32", "bf16"):
        recipe = make_recipe(sh.zero_size, T, B, "concept", 0, env, n + 2, (f"train.precision={precision}",))
        if windows is None:  # (B, T + 1) random windows, the same stream for both precisions
            windows = [w.to(env.device) for w in random_windows(recipe.model_config.vocab_size, B, T, 7, rs.bf16_batches)]
        engine = build_engine(recipe, env, seed=0)
        try:
            losses, secs = [], []
            for s in range(n):
                w = windows[s % len(windows)]
                dt, loss = timed(engine_step(engine, w[:, :-1], w[:, 1:]), env)
                losses.append(loss)
                secs.append(dt)
            runs[precision] = {"losses": losses, "median_s": statistics.median(secs[1:] or secs),
                               "optimizer": type(engine.optimizer).__name__, "adam_steps": _adam_steps(engine),
                               "finite": all(math.isfinite(v) for v in losses), "decreased": losses[-1] < losses[0]}
        finally:
            release(engine)
            _free_runs(env)
    last = rs.bf16_last
    f, b = runs["fp32"]["losses"][-last:], runs["bf16"]["losses"][-last:]
    diff = sum(abs(x - y) for x, y in zip(f, b)) / last
    out = {"size": sh.zero_size, "variant": "concept", "zero_stage": 0, "seq_len": T, "batch": B, "steps": n,
           "batches": rs.bf16_batches, "last": last, "runs": runs, "mean_abs_diff_last": diff,
           "diff_of_means_last": abs(sum(b) / last - sum(f) / last),
           "first_loss_diff": abs(runs["fp32"]["losses"][0] - runs["bf16"]["losses"][0]), "tol": BF16_TOL}
    out["ok"] = (diff <= BF16_TOL and runs["bf16"]["adam_steps"] == n
                 and all(r["finite"] and r["decreased"] for r in runs.values()))
    return out


def packed_documents(B: int, T: int, lengths: tuple[int, int], seed: int) -> Any:
    """(B, T) int64 numpy: each row's per-token document index (0, 0, ..., 1, 1, ...), documents
    of lengths uniform in ``lengths`` (the last one cut by the window), as ``WindowLoader.documents``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        lens: list[int] = []
        while sum(lens) < T:
            lens.append(int(rng.integers(lengths[0], lengths[1] + 1)))
        rows.append(np.repeat(np.arange(len(lens)), lens)[:T])
    return np.stack(rows).astype(np.int64)


class _Packed:
    """The loader method ``DocumentHooks.inputs`` reads: the last batch's per-token document index."""

    def __init__(self, docs: Any):
        self.docs = docs

    def last_documents(self) -> Any:
        return self.docs


def _dynamo_counts() -> tuple[int, int]:
    """(graphs dynamo made, frames it compiled) so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(counters["frames"]["ok"])


def documents_part(engine: Any, recipe: Any, sh: Any, rs: RunShapes, env: Any) -> dict[str, Any]:
    """Part b: masked (packed documents) vs unmasked steps of one engine, and dynamo's graphs."""
    import torch

    from ncpctl.model.core import patterns
    from ncpctl.profile.step import random_windows
    from ncpctl.profile.timing import timed as timed_call
    from ncpctl.train.hooks import Hooks

    T, B, n = sh.seq_len, sh.batch, rs.doc_batches
    model, hooks = engine.module, Hooks(recipe)
    windows = [w.to(env.device) for w in random_windows(recipe.model_config.vocab_size, B, T, 11, n)]
    docs = [packed_documents(B, T, rs.doc_lengths, 100 + i) for i in range(n)]

    def step(i: int, masked: bool) -> Callable[[], Any]:
        def run() -> Any:
            # the loop's path: the loader's documents -> DocumentHooks -> {"doc_ids": (B, T) on the device}
            (kw,) = hooks.inputs(_Packed(docs[i]), 1, B, env.device) if masked else ({},)
            o = engine(windows[i][:, :-1], windows[i][:, 1:], **kw)
            engine.backward(o.loss)
            engine.step()
            return o.loss.detach()

        return run

    timed(step(0, False), env)  # warm-up of the unmasked path
    g0 = _dynamo_counts()
    first_s, first_loss = timed(step(0, True), env)  # FlexAttention compiles here on a GPU
    graphs = [[c - c0 for c, c0 in zip(_dynamo_counts(), g0)]]
    secs: dict[str, list[float]] = {"masked": [], "unmasked": []}
    losses = [first_loss]
    for i in range(1, n):
        for masked in ((True, False) if i % 2 else (False, True)):
            dt, loss = timed(step(i, masked), env)
            secs["masked" if masked else "unmasked"].append(dt)
            if masked:
                losses.append(loss)
                graphs.append([c - c0 for c, c0 in zip(_dynamo_counts(), g0)])
    build = []
    for d in docs:  # timed reads a loss: the masks' own timing here
        doc = torch.from_numpy(d).to(env.device)
        build.append(timed_call(lambda: patterns.document_masks(set(model.token_patterns), doc),
                                env.device if env.on_gpu else None)[0])
    return {"size": sh.train_size, "seq_len": T, "batch": B, "batches": n, "doc_lengths": list(rs.doc_lengths),
            "documents_per_row": statistics.mean(int(d[r, -1]) + 1 for d in docs for r in range(B)),
            # False on a GPU: FlexAttention failed and is off for the process (flex_off says why)
            "flex": patterns.flex_enabled(env.device), "flex_off": patterns._FLEX_OFF, "first_masked_s": first_s,
            "median_ms": {k: 1e3 * statistics.median(v) for k, v in secs.items()},
            "masked_over_unmasked": paired_ratios(secs["masked"], secs["unmasked"])["paired_median"],
            "mask_build_ms": 1e3 * statistics.median(build), "masked_losses": losses,
            "finite": all(math.isfinite(v) for v in losses),
            "graphs": [g for g, _ in graphs], "frames": [f for _, f in graphs],
            "no_recompile": all(g == graphs[0] for g in graphs)}


def checkpointing_part(engine: Any, recipe: Any, sh: Any, rs: RunShapes, env: Any) -> dict[str, Any]:
    """Part c: one engine, each checkpointing mode swapped in from outside; memory and step time."""
    import torch

    from ncpctl.model.accounting.memory import activation_memory
    from ncpctl.profile.step import engine_step
    from ncpctl.train.recompute import apply_activation_checkpointing

    T, B = sh.seq_len, sh.batch
    cfg = recipe.model_config
    est = activation_memory(cfg, T, B, "bf16" if env.bf16 else "fp32")  # flash SDPA: no T x T scores
    x, y = _batch(cfg, B, T, env)
    modes: dict[str, Any] = {}
    try:
        for mode in CKPT_MODES:
            n_mods = apply_activation_checkpointing(engine.module, mode)
            _free_runs(env)
            if env.on_gpu:
                torch.cuda.reset_peak_memory_stats()
            before, after_fwd = _mem(env, "memory_allocated"), []

            def probed() -> Any:
                o = engine(x, y)
                after_fwd.append(_mem(env, "memory_allocated"))  # what the forward left saved (and the loss)
                engine.backward(o.loss)
                engine.step()
                return o.loss.detach()

            dt, loss = timed(probed, env)
            peak = _mem(env, "max_memory_allocated")
            m = {"checkpointed_modules": n_mods, "first_step_s": dt, "loss": loss,
                 "estimate_total_bytes": est.total(mode), "estimate_saved_bytes": est.saved(mode),
                 "peak_above_bytes": None if before is None else peak - before,
                 "forward_end_bytes": None if before is None else after_fwd[0] - before}
            m["peak_over_estimate"] = None if before is None else m["peak_above_bytes"] / m["estimate_total_bytes"]
            m["forward_end_over_estimate"] = None if before is None else m["forward_end_bytes"] / m["estimate_saved_bytes"]
            modes[mode] = m
        step = engine_step(engine, x, y)
        secs: dict[str, list[float]] = {m: [] for m in CKPT_MODES}
        for r in range(rs.ckpt_rounds):
            for mode in (CKPT_MODES if r % 2 == 0 else CKPT_MODES[::-1]):
                apply_activation_checkpointing(engine.module, mode)
                secs[mode].append(timed(step, env)[0])
    finally:
        apply_activation_checkpointing(engine.module, "none")
    for mode in CKPT_MODES:
        modes[mode].update(seconds=secs[mode], median_s=statistics.median(secs[mode]),
                           over_none=paired_ratios(secs[mode], secs["none"])["paired_median"])
    return {"size": sh.train_size, "variant": "concept", "zero_stage": 1, "seq_len": T, "batch": B,
            "precision": est.dtype, "estimate_attention": est.attention, "modes": modes}


@contextlib.contextmanager
def compile_backend(backend: str) -> Iterator[None]:
    """``build_engine`` compiles the blocks with ``backend`` (``compile_blocks``'s default: inductor)."""
    import ncpctl.train.compiled as compiled

    real = compiled.compile_blocks
    if backend != "inductor":
        compiled.compile_blocks = functools.partial(real, backend=backend)
    try:
        yield
    finally:
        compiled.compile_blocks = real


def compile_part(sh: Any, rs: RunShapes, env: Any) -> dict[str, Any]:
    """Part d: the base model eager vs ``train.compile: true``, same seed and batch."""
    from ncpctl.profile.step import engine_step
    from ncpctl.train.compiled import why_not

    T, B, steps = sh.seq_len, sh.batch, rs.compile_warmup + rs.compile_rounds + 2
    engines: dict[str, Any] = {}
    try:
        engines["eager"] = build_engine(make_recipe(sh.train_size, T, B, "base", 1, env, steps), env, seed=0)
        with compile_backend(rs.compile_backend):
            recipe = make_recipe(sh.train_size, T, B, "base", 1, env, steps, ("train.compile=true",))
            engines["compiled"] = build_engine(recipe, env, seed=0)
        x, y = _batch(recipe.model_config, B, T, env)
        run = {n: engine_step(e, x, y) for n, e in engines.items()}
        first_eager_s, first_eager = timed(run["eager"], env)
        g0 = _dynamo_counts()
        warm = [timed(run["compiled"], env) for _ in range(rs.compile_warmup)]
        g1 = _dynamo_counts()
        secs: dict[str, list[float]] = {n: [] for n in run}
        for r in range(rs.compile_rounds):
            for n in (list(run) if r % 2 == 0 else list(run)[::-1]):
                secs[n].append(timed(run[n], env)[0])
        g2 = _dynamo_counts()
        # compile_blocks compiles each block's forward in place (an instance attribute)
        compiled_blocks = sum("forward" in vars(m) for m in engines["compiled"].module.modules())
    finally:
        for e in engines.values():
            release(e)
    med = {n: statistics.median(s) for n, s in secs.items()}
    tol = 1e-2 if env.bf16 else 1e-4
    diff = abs(warm[0][1] - first_eager)
    return {"size": sh.train_size, "variant": "base", "zero_stage": 1, "seq_len": T, "batch": B,
            "backend": rs.compile_backend, "compiled_blocks": compiled_blocks,
            "eager_reason": why_not(env.on_gpu, rs.compile_backend),
            "first_loss": {"eager": first_eager, "compiled": warm[0][1]}, "first_loss_diff": diff,
            "first_loss_tol": tol, "first_loss_match": diff <= tol,
            "first_steps_s": {"eager": first_eager_s, "compiled": [dt for dt, _ in warm]},
            "compile_s": sum(dt for dt, _ in warm) - rs.compile_warmup * med["compiled"],
            "median_ms": {n: 1e3 * m for n, m in med.items()},
            "compiled_over_eager": paired_ratios(secs["compiled"], secs["eager"])["paired_median"],
            "graphs": {"warmup": g1[0] - g0[0], "after_warmup": g2[0] - g1[0]},
            "frames": {"warmup": g1[1] - g0[1], "after_warmup": g2[1] - g1[1]}}


def runs_summary_lines(r: dict[str, Any]) -> list[str]:
    """gpu_check's summary lines for section 9."""
    lines = ["[9] real runs (issue 27)"]
    a = r.get("bf16")
    if a:
        f, b = a["runs"]["fp32"], a["runs"]["bf16"]
        lines.append(f"    a bf16 vs fp32, {a['size']} ConceptLM ZeRO-0, {a['steps']} steps: mean|diff| last {a['last']} "
                     f"{a['mean_abs_diff_last']:.4f} nats (tol {a['tol']}); fp32 {f['losses'][0]:.3f} -> {f['losses'][-1]:.3f}, "
                     f"bf16 {b['losses'][0]:.3f} -> {b['losses'][-1]:.3f} ({b['optimizer']}, AdamW steps {b['adam_steps']}); ok {a['ok']}")
    d = r.get("documents")
    if d:
        lines.append(f"    b document mask {d['size']} T={d['seq_len']} B={d['batch']} ({d['documents_per_row']:.1f} docs/row, "
                     f"flex {d['flex']}): masked/unmasked {d['masked_over_unmasked']:.3f} ({d['median_ms']['masked']:.1f} / "
                     f"{d['median_ms']['unmasked']:.1f} ms; first masked {d['first_masked_s']:.1f} s; masks {d['mask_build_ms']:.2f} ms); "
                     f"graphs per batch {d['graphs']}: no recompile {d['no_recompile']}")
    c = r.get("checkpointing")
    if c:
        for mode, m in c["modes"].items():
            mem = ("n/a" if m["peak_above_bytes"] is None else
                   f"{m['peak_above_bytes'] / 2**30:.2f} GiB ({m['peak_over_estimate']:.2f}x est.), forward end "
                   f"{m['forward_end_bytes'] / 2**30:.2f} GiB ({m['forward_end_over_estimate']:.2f}x)")
            lines.append(f"    c checkpointing {mode:9} {m['median_s'] * 1e3:8.1f} ms ({m['over_none']:.3f}x none), step peak "
                         f"above base {mem}; estimate {m['estimate_total_bytes'] / 2**30:.3f} GiB")
    k = r.get("compile")
    if k:
        lines.append(f"    d compile ({k['backend']}, {k['compiled_blocks']} blocks) {k['size']}: compiled/eager "
                     f"{k['compiled_over_eager']:.3f} ({k['median_ms']['compiled']:.1f} / {k['median_ms']['eager']:.1f} ms), "
                     f"compile {k['compile_s']:.1f} s, first-loss diff {k['first_loss_diff']:.2e} (tol {k['first_loss_tol']:g}), "
                     f"graphs {k['graphs']}")
    lines += [f"    ERROR in {n}: {e['error']}" for n, e in r.get("errors", {}).items()]
    return lines


# ----------------------------------------------------------------------------- --profile: where the time goes

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMemcpy")


def where_time_goes(fn: Callable[[], Any], n: int, env: Env, top: int = 12) -> dict[str, Any]:
    """Time ``n`` calls of ``fn`` (after the caller's warm-up), then profile ``n`` more: wall time per call, the device's
    kernel time per call (their sum; wall >> kernels means launch- or host-bound), kernel launches
    and host-synchronising runtime calls per call, and the top ops by CPU total and the top
    kernels by device time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.on_gpu else [])
    env.sync()
    t0 = time.perf_counter()  # timed without the profiler: its start-up (~1 s once) would land in the wall
    for _ in range(n):
        fn()
    env.sync()
    wall = (time.perf_counter() - t0) / n
    with profile(activities=acts) as prof:
        for _ in range(n):
            fn()
        env.sync()
    ev = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    runtime = {e.key: e.count for e in ev if e.key.startswith("cuda")}
    cpu_top = sorted((e for e in ev if not e.key.startswith("cuda")), key=lambda e: -e.cpu_time_total)[:top]
    by_kernel: dict[str, list[float]] = {}
    for k in kernels:
        by_kernel.setdefault(k.name[:120], []).append(k.device_time_total if hasattr(k, "device_time_total")
                                                      else k.cuda_time_total)
    k_top = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"calls": n, "wall_ms": 1e3 * wall, "kernel_ms": sum(sum(v) for v in by_kernel.values()) / 1e3 / n,
            "kernels_per_call": len(kernels) / n,
            "launches_per_call": sum(c for k, c in runtime.items() if "Launch" in k) / n,
            "syncs_per_call": {k: runtime[k] / n for k in SYNC_CALLS if k in runtime},
            "top_cpu_ms_per_call": [(e.key[:80], round(e.cpu_time_total / 1e3 / n, 3), e.count // n) for e in cpu_top],
            "top_kernels_ms_per_call": [(k, round(sum(v) / 1e3 / n, 3), len(v) // n) for k, v in k_top]}


def profile_decode(sh: Shapes, env: Env) -> dict[str, Any]:
    """Section 4's decode step (batch 1, bf16) with the concept path on and off."""
    import torch

    from ncpctl.model.core.config import build_config
    from ncpctl.model.core.model import NCPModel

    dtype = torch.bfloat16 if env.bf16 else torch.float32
    out: dict[str, Any] = {}
    for name, on in (("base", False), ("concept", True)):
        cfg = build_config(sh.decode_size, concept=dict(enabled=on))
        torch.manual_seed(0)
        model = NCPModel(cfg).to(env.device, dtype=dtype).eval()
        prompts = torch.randint(0, cfg.vocab_size, (1, sh.prompt_len)).to(env.device)
        with torch.no_grad():
            _, state = model.prefill(prompts, [sh.prompt_len], max_len=sh.prompt_len + 64)
            nxt = prompts[:, -1]
            step = lambda: model.decode_step(state, nxt)  # noqa: E731  (the same token fed: timing only)
            for _ in range(8):
                step()
            out[name] = where_time_goes(step, 16, env)
            g = _greedy(model, prompts, 64, cfg.vocab_size, env)  # section 4's loop, for comparison
            out[name]["greedy_ms_per_token"] = 1e3 * g["decode_s"] / 64
            if on:  # the step generation takes on CUDA: one replayed graph of the static step
                from ncpctl.inference.cuda_graphs import GraphedSteps
                from ncpctl.model.core.decode_static import StaticDecoder

                _, state = model.prefill(prompts, [sh.prompt_len], max_len=sh.prompt_len + 48)
                gs = GraphedSteps(model, state) if env.on_gpu else StaticDecoder(model, state)
                for _ in range(8):  # warm-up and the capture
                    gs.step(nxt)
                out["concept_graphed"] = where_time_goes(lambda: gs.step(nxt), 16, env)
                out["concept_graphed"]["eager_reason"] = getattr(gs, "eager_reason", "no CUDA: the static step, eager")
        del model, state
        _free(env)
    return out


def profile_train(sh: Shapes, env: Env) -> dict[str, Any]:
    """Section 1's base step and section 6's plain and IRC+CRC steps."""
    from ncpctl.profile.step import engine_step

    out: dict[str, Any] = {}
    recipes = {"base": make_recipe(sh.train_size, sh.seq_len, sh.batch, "base", 1, env, 8),
               "arch_plain": _arch_recipe(sh, "plain", env), "arch_irc_crc": _arch_recipe(sh, "irc_crc", env)}
    for name, recipe in recipes.items():
        engine = build_engine(recipe, env)
        x, y = _batch(recipe.model_config, sh.batch, sh.seq_len, env)
        step = engine_step(engine, x, y)
        for _ in range(2):
            step()
        out[name] = where_time_goes(step, 2, env)
        release(engine)
        del engine, step
        _free(env)
    return out


# ----------------------------------------------------------------------------- report


def _gb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def summary(res: dict[str, Any]) -> str:
    e = res["env"]
    lines = [f"gpu_check{' --dry' if res['dry'] else ''}: {e['device_name']}, torch {e['torch']}, CUDA {e['cuda']}, "
             f"deepspeed {e['deepspeed']}; measured in {res['wall_s']:.0f} s"]
    t = res.get("train_step")
    if t:
        lines.append(f"[1] train step {t['size']} T={t['seq_len']} B={t['batch']} ZeRO-{t['zero_stage']} {t['precision']}, "
                     f"peak {t['peak'] / 1e12:.1f} TFLOP/s ({t['peak_source']})")
        for n, m in t["models"].items():
            lines.append(f"    {n:9} {m['median_s'] * 1e3:9.2f} ms  {m['tokens_per_s']:12,.0f} tok/s  MFU {100 * m['mfu']:5.1f}% "
                         f"(full-attention FLOPs; causal count {100 * m['mfu_causal']:5.1f}%)  loss {m['first_loss']:.3f} -> "
                         f"{m['last_loss']:.3f}  {m['optimizer']}")
        lines.append(f"    ours (base) / plain-PyTorch reference: {t['ours_over_reference']:.3f} (paired median; reference: "
                     f"{t['reference']['what']})")
    s = res.get("sdpa")
    if s:
        lines.append(f"[2] SDPA flags {s['sdp_flags']}" + (f"; fused flash-class kernel as expected: {s['expected_flash']}" if "expected_flash" in s else ""))
        for n, m in s["models"].items():
            lines.append(f"    {n:8} backend {m['backend']} (ops say {m['backend_from_ops']}); kernels: "
                         + (", ".join(k[:70] for k in m["attention_kernels"][:4]) or "-"))
    z = res.get("zero")
    if z:
        lines.append(f"[3] ZeRO {z['size']} ({z['variant']}) T={z['seq_len']} B={z['batch']}, {z['steps']} steps: "
                     f"first-loss diff {z['first_loss_diff']:.2e} (tol {z['first_loss_tol']:g}); ok {z['ok']}")
        for st in ("zero1", "zero1_zero_optimizer", "zero2"):
            if st not in z:
                continue
            q = z[st]
            lines.append(f"    {st:20} {q['median_s'] * 1e3:9.2f} ms  peak {_gb(q['peak_bytes'])}  loss {q['losses'][0]:.4f} -> "
                         f"{q['losses'][-1]:.4f}  {q['optimizer']}")
        if "bf16_optimizer_over_zero_optimizer" in z:
            lines.append(f"    ZeRO-1 step, BF16_Optimizer / ZeRO optimizer: {z['bf16_optimizer_over_zero_optimizer']:.3f}")
    d = res.get("decode")
    if d:
        own = " (a process of its own)" if d.get("process", {}).get("own") else ""
        lines.append(f"[4] decode {d['size']} ConceptLM {d['dtype']}, prompt {d['prompt_len']} + {d['new_tokens']} greedy{own}, "
                     f"{d['path']} vs eager decode_step; ok {d['ok']}")
        for B, b in d["batches"].items():
            e = b["eager"]
            lines.append(f"    batch {B:3} {b['tokens_per_s']:10,.0f} tok/s (eager {e['tokens_per_s']:,.0f}: {b['over_eager']:.2f}x)  "
                         f"(prefill {b['prefill_s'] * 1e3:.1f} ms)  cached vs full max|diff| {b['max_abs_diff']:.2e} "
                         f"(eager {e['max_abs_diff']:.2e}) of {b['logit_scale']:.2f}; argmax same {b['argmax_match']}; "
                         f"tokens as eager {100 * b['tokens_same_as_eager']:.0f}%" + (f"; EAGER: {b['eager_reason']}"
                                                                                        if b["eager_reason"] else ""))
    c = res.get("concept_vs_pm")
    if c:
        lines.append(f"[5] ConceptLM/PM {c['size']}: time ratio {c['time_ratio']:.3f} (best rounds {c['time_ratio_best_rounds']:.3f}) "
                     f"vs FLOPs ratio {c['flops_ratio']:.3f}: difference {c['difference']:+.3f} (goal within {c['goal']}: "
                     f"{'MET' if c['within_goal'] else 'MISSED'})")
    a = res.get("archpreview")
    if a:
        lines.append(f"[6] NCP-ArchPreview design {a['shape']} T={a['seq_len']} B={a['batch']} ZeRO-2 Muon: IRC+CRC/plain "
                     f"{a['irc_crc_over_plain']:.3f} (FLOPs share {100 * a['residual_flops_share']:.2f}%; goal <= 1.05), "
                     f"+MTP {a['mtp_over_irc_crc']:.3f}; cached decode max|diff| {a['decode']['max_abs_diff']:.2e}; ok {a['ok']}")
        for n, m in a["models"].items():
            sp = m.get("split")
            lines.append(f"    {n:12} {m['median_s'] * 1e3:9.2f} ms  loss {m['losses'][0]:.3f} -> {m['losses'][-1]:.3f}  "
                         f"{m['optimizer']}" + (f"; optimizer step {sp['optimizer_s'] * 1e3:.1f} ms = "
                                                f"{100 * sp['optimizer_share']:.1f}% of the step" if sp else ""))
    if "dlcm" in res:
        a, dd = res["dlcm"]["attention"], res["dlcm"]["decode"]
        lines.append(f"[7] DLCM attention ({a['dtype']}): faster {a['faster_form']} (replicated / per_concept "
                     f"{a['replicated_over_per_concept_gmean']:.2f}); the default {a['configured_form']} is "
                     f"{'the faster' if a['configured_is_faster'] else 'the slower'} kernel here")
        for B, r in dd["batches"].items():
            lines.append(f"    decode batch {B}: DLCM {r['dlcm_ms']:.2f} ms/step, /matched base {r['ratio_matched']:.3f}, "
                         f"/token-layer base {r['ratio_token']:.3f} (goal <= 1.2 matched)")
        lines.append(f"    decode at {dd['tokens_per_concept']:.2f} tokens per concept (R = 4 by the calibrated "
                     f"threshold {dd['boundary_threshold']:.4f})")
    c8 = res.get("cdlm")
    if c8:
        lines.append(f"[8] CDLM {c8['size']} block {c8['block']} T={c8['seq_len']} B={c8['batch']}: CDLM/AR step "
                     f"{c8['cdlm_over_ar']:.3f} (goal <= {c8['goal']}); masked attention backend {c8['cdlm_backend']} "
                     f"(ops say {c8['cdlm_backend_from_ops']}); model on FlexAttention {c8['model_flex']['uses_flex']}, "
                     f"flex vs mask logits max|diff| {c8['model_flex']['max_abs_diff']:.2e} of {c8['model_flex']['logit_scale']:.2f}; "
                     f"ok {c8['ok']}")
        for f in c8["flex"]:
            ms = f["median_ms"]
            lines.append(f"    attention {f['timed']} T={f['T']}: SDPA+mask {ms['sdpa_mask']:.2f} ms, flex {ms['flex']:.2f} ms "
                         f"({f['flex_over_sdpa_mask']:.2f}x), is_causal {ms['sdpa_causal']:.2f} ms; flex vs mask "
                         f"max|diff| {f['max_abs_diff']:.2e} of {f['scale']:.2f}")
    if "real_runs" in res:
        lines += runs_summary_lines(res["real_runs"])
    f = res.get("fused_ce")
    if f:
        lines.append(f"[10] fused LM head + loss N={f['tokens']} d={f['d_model']} V={f['vocab']} {f['dtype']}: ours vs {f['other']}"
                     + ("" if "ok" not in f else
                        f": loss diff {f['loss_diff']:.2e}, grad h {f['grad_h_diff']:.2e}, grad W {f['grad_w_diff']:.2e} "
                        f"(tol {f['tol']:g}); ok {f['ok']}; {f['median_ms']['ours']:.2f} vs {f['median_ms']['other']:.2f} ms "
                        f"({f['other_over_ours']:.2f}x), peak above inputs {_gb(f['peak_above_inputs_bytes']['ours'])} vs "
                        f"{_gb(f['peak_above_inputs_bytes']['other'])}"))
    lines += goal_lines(res.get("goals", {}))
    failed = [k for k, v in res.get("checks", {}).items() if not v]
    lines.append(f"checks: {'all passed' if not failed else 'FAILED ' + ', '.join(failed)} ({len(res.get('checks', {}))} run)")
    for name, err in res["errors"].items():
        lines.append(f"ERROR in {name}: {err['error']}")
    return "\n".join(lines)


def goal_lines(g: dict[str, Any]) -> list[str]:
    """Issue 45's goal table."""
    if not g:
        return []
    lines = ["goals (issue 45; speed, not checks):"]
    for v in g.values():
        val = "not measured" if v["value"] is None else f"{v['value']:.3f}"
        verdict = "" if v["met"] is None else ("MET" if v["met"] else "MISSED")
        lines.append(f"    {v['what']:62} {val:>12}  goal {v['goal']:>9}  {verdict}")
    return lines


def profile_summary(res: dict[str, Any]) -> str:
    lines = []
    for sec in ("profile_decode", "profile_train"):
        for name, p in res.get(sec, {}).items():
            lines.append(f"{sec} {name}: wall {p['wall_ms']:.2f} ms/call, kernels {p['kernel_ms']:.2f} ms/call, "
                         f"{p['kernels_per_call']:.0f} kernels, {p['launches_per_call']:.0f} launches, syncs {p['syncs_per_call']}"
                         + (f"; section 4's greedy loop {p['greedy_ms_per_token']:.2f} ms/token" if "greedy_ms_per_token" in p else ""))
            lines += [f"    cpu  {ms:9.3f} ms x{c:<5} {k}" for k, ms, c in p["top_cpu_ms_per_call"]]
            lines += [f"    gpu  {ms:9.3f} ms x{c:<5} {k}" for k, ms, c in p["top_kernels_ms_per_call"]]
    lines += [f"ERROR in {n}: {e['error']}" for n, e in res["errors"].items()]
    return "\n".join(lines)


def checks(res: dict[str, Any]) -> dict[str, bool]:
    """Correctness verdicts (not speed goals) of the sections that ran; all must hold for exit 0."""
    out: dict[str, bool] = {}
    if "train_step" in res:
        out["train_losses_finite"] = all(m["finite"] for m in res["train_step"]["models"].values())
    if "expected_flash" in res.get("sdpa", {}):
        out["sdpa_flash"] = res["sdpa"]["expected_flash"]
    if "zero" in res:
        z = res["zero"]
        out["zero_first_loss_match"] = z["first_loss_match"]
        out["zero_losses_finite_and_falling"] = all(z[s][k] for s in ("zero1", "zero2") for k in ("finite", "decreased"))
    if "decode" in res:
        out["decode_cached_equals_full"] = res["decode"]["ok"]
    if "archpreview" in res:
        out["archpreview_trains_and_decodes"] = res["archpreview"]["ok"]
    if "cdlm" in res:
        out["cdlm_trains_and_flex_matches"] = res["cdlm"]["ok"]
    if "real_runs" in res:
        out.update(runs_checks(res["real_runs"]))
    if "ok" in res.get("fused_ce", {}):
        out["fused_ce_matches_ours"] = res["fused_ce"]["ok"]
    return out


def goals(res: dict[str, Any]) -> dict[str, Any]:
    """Issue 45's goals (``GOALS``) from the sections that ran: value, goal, met. Speed, not checks:
    a missed goal does not fail the run (``--dry``'s values mean nothing)."""
    t, d = res.get("train_step"), res.get("decode", {}).get("batches", {})
    values = {
        "mfu_base": t and t["models"]["base"]["mfu"],
        "ours_over_reference": t and t["ours_over_reference"],
        "concept_pm_difference": res.get("concept_vs_pm", {}).get("difference"),
        "irc_crc_over_plain": res.get("archpreview", {}).get("irc_crc_over_plain"),
        "muon_share": res.get("archpreview", {}).get("muon_share"),
        "decode_b1_tokens_per_s": d.get("1", {}).get("tokens_per_s"),
        "decode_b8_tokens_per_s": d.get("8", {}).get("tokens_per_s"),
    }
    out = {}
    for key, (what, section, goal, sense) in GOALS.items():
        v = values[key]
        out[key] = {"what": what, "section": section, "goal": f"{sense} {goal:g}", "value": v,
                    "met": None if v is None else (v >= goal if sense == ">=" else v <= goal)}
    return out


def _env_info(env: Env) -> dict[str, Any]:
    import torch

    from ncpctl.profile.timing import package_version as _version  # the decode process imports no DeepSpeed

    info: dict[str, Any] = {"device": str(env.device), "torch": torch.__version__, "cuda": torch.version.cuda,
                            "deepspeed": _version("deepspeed"), "liger_kernel": _version("liger-kernel"),
                            "triton": _version("triton"), "cpu_cores": os.cpu_count(),
                            "loadavg_1min": round(os.getloadavg()[0], 2), "threads": torch.get_num_threads()}
    if env.on_gpu:
        p = torch.cuda.get_device_properties(env.device)
        info.update(device_name=p.name, memory_bytes=p.total_memory, capability=f"{p.major}.{p.minor}",
                    cudnn=torch.backends.cudnn.version())
    else:
        info["device_name"] = "CPU"
    return info


def _write(res: dict[str, Any], path: str | None) -> None:
    """The JSON so far to ``path`` (atomically), so a run cut short keeps what it measured."""
    if path and path != "-":
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(res, indent=2) + "\n")
        os.replace(tmp, path)


def _env(args: argparse.Namespace, selected: list[str]) -> Env:
    """The device and precision; the distributed world of one (DeepSpeed imported) only when a
    selected section builds engines."""
    import torch

    from ncpctl.profile.timing import device_peak

    d = None
    if ENGINE_SECTIONS & set(selected):
        from ncpctl.train.engine import init_distributed

        d = init_distributed()  # a world of one on localhost, as `ncpctl pretrain` without a launcher
        device = d.device
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    on_gpu = device.type == "cuda"
    peak, source = device_peak(on_gpu)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and on_gpu)  # train.precision's rule
    return Env(device, on_gpu, bf16=bf16, peak=peak, peak_source=source, dist=d)


def run(args: argparse.Namespace, sh: Shapes) -> dict[str, Any]:
    t_start = time.perf_counter()
    selected = ["profile_decode", "profile_train"] if args.profile else args.only.split(",") if args.only else list(SECTIONS)
    env = _env(args, selected)
    res: dict[str, Any] = {"ok": False, "dry": args.dry, "env": _env_info(env), "shapes": dict(vars(sh)),
                           "sections": selected, "errors": {}, "section_s": {}, "wall_s": 0.0}
    held: dict[str, Any] = {}  # section 1's engines and step functions, for sections 2 and 5

    def section(name: str, fn: Callable[[], Any]) -> None:
        if name not in selected:
            return
        _say(f"gpu_check: {name} ...")
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:  # one failing section must not cost the others' numbers
            res["errors"][name] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-6000:]}
            _say(f"gpu_check: {name} FAILED: {type(e).__name__}: {e}")
        finally:
            res["section_s"][name] = round(time.perf_counter() - t0, 2)
            res["wall_s"] = round(time.perf_counter() - t_start, 2)
            _write(res, args.json)

    def keep(name: str) -> Callable[[dict[str, Any]], None]:
        """A section's result so far into the JSON (a section of several parts, cut short, keeps the parts done)."""
        def write(partial: dict[str, Any]) -> None:
            res[name] = partial
            _write(res, args.json)

        return write

    def train() -> dict[str, Any]:
        result, trained = train_section(sh, env)
        held.update(trained)
        return result

    def needs_train(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            if "train_step" not in res:
                raise RuntimeError("needs section train_step, which failed or was not selected")
            return fn()

        return call

    if args.profile:  # diagnosis only: where the time of a decode step and a training step goes
        section("profile_decode", lambda: profile_decode(sh, env))
        section("profile_train", lambda: profile_train(sh, env))
        res["ok"] = not res["errors"]
        _write(res, args.json)
        return res
    # decoding first and in a process of its own (issue 45 measures it so), unless it is this process's only job
    section("decode", (lambda: decode_section(sh, env)) if args.only else (lambda: decode_own_process(args)))
    section("train_step", train)
    section("sdpa", needs_train(lambda: sdpa_section(held, env)))
    section("concept_vs_pm", needs_train(lambda: concept_vs_pm(res["train_step"])))
    for engine in held.get("engines", {}).values():  # free section 1's engines before section 3 measures memory
        release(engine)
    held.clear()
    _free(env)
    section("fused_ce", lambda: fused_ce_section(sh, env))
    section("zero", lambda: zero_section(sh, env))
    section("archpreview", lambda: archpreview_section(sh, env))
    section("dlcm", lambda: dlcm_section(sh, env))
    section("cdlm", lambda: cdlm_section(sh, env))
    section("real_runs", lambda: real_runs(sh, env, args.dry, keep("real_runs")))
    for part, err in res.get("real_runs", {}).get("errors", {}).items():  # a failed part fails the run
        res["errors"][f"real_runs.{part}"] = err
    res["process_s"] = round(time.perf_counter() - _T_PROCESS, 2)
    res["checks"] = checks(res)
    res["goals"] = goals(res)
    res["ok"] = not res["errors"] and all(res["checks"].values())
    res["wall_s"] = round(time.perf_counter() - t_start, 2)
    _write(res, args.json)  # the verdicts too: the sections' writes came before them
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry", action="store_true", help="CPU smoke run of the same code with tiny shapes")
    ap.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH ('-' = stdout)")
    ap.add_argument("--rounds", type=int, help="timed rounds per model in section 1 (default 12; --dry 2)")
    ap.add_argument("--batch", type=int, help="micro batch for sections 1 and 3 (default 8; --dry 2)")
    ap.add_argument("--profile", action="store_true",
                    help="diagnosis instead of the check: profile decode and training steps (where the time goes)")
    ap.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                    help="as train.precision: auto = bf16 on a GPU, fp32 on the CPU")
    ap.add_argument("--only", metavar="SECTIONS",
                    help=f"comma-separated sections to run, in this process (default: all; {', '.join(SECTIONS)})")
    args = ap.parse_args(argv)
    unknown = set(args.only.split(",")) - set(SECTIONS) if args.only else set()
    if unknown:
        print(f"error: --only: unknown section(s) {', '.join(sorted(unknown))} (known: {', '.join(SECTIONS)})",
              file=sys.stderr)
        return 2

    import torch

    from ncpctl.train.command import stdout_to_stderr  # DeepSpeed's stdout kept off the JSON

    if not args.dry and not torch.cuda.is_available():
        print("error: no CUDA device (torch.cuda.is_available() is False); run this on a GPU, "
              "or `python bench/gpu_check.py --dry` for the CPU smoke run", file=sys.stderr)
        return 2
    sh = DRY_SHAPES if args.dry else GPU_SHAPES
    over = {k: v for k, v in (("rounds", args.rounds), ("batch", args.batch)) if v is not None}
    sh = Shapes(**{**vars(sh), **over})
    with stdout_to_stderr():
        res = run(args, sh)
    text = profile_summary(res) if args.profile else summary(res)
    if args.json == "-":
        _say(text)
        print(json.dumps(res, indent=2))
    else:
        print(text)
        if args.json:
            print(f"JSON: {args.json}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
