"""The ZeRO stage a run trains at, and the DeepSpeed config generated around it (one source of truth
for batch sizes: everything here derives from the recipe).

* ``Zero``: the one owner of ``deepspeed.zero_stage``. What depends on the stage asks it (are the
  parameters partitioned, does DeepSpeed wrap our optimizer, how does the optimizer state lie on
  disk, which bf16 optimizer does DeepSpeed build) instead of comparing the number itself.
  ``Zero.of(recipe)`` is this run's; ``Zero(stage)`` a checkpoint's (ncpctl.json records the stage).
* ``deepspeed_config(recipe, on_gpu)``: the DeepSpeed JSON config; ``deepspeed.extra`` merged last.
* ``use_bf16`` (``train.precision``) and ``guard_in_optimizer``: at stage 0 in fp32 DeepSpeed hands
  our optimizer the raw gradients, so ``ncpctl.train.optimizer.GuardedAdamW`` clips, measures the
  norm and skips a non-finite step itself (DeepSpeed's own clipping is switched off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ncpctl.model.core.config import deep_merge


@dataclass(frozen=True)
class Zero:
    """A ZeRO stage (0-3) and whether the optimizer state is offloaded to the CPU."""

    stage: int
    offload: bool = False

    @classmethod
    def of(cls, recipe: Any) -> "Zero":
        """The recipe's ``deepspeed.zero_stage`` / ``deepspeed.offload_optimizer``."""
        return cls(recipe.deepspeed.zero_stage, recipe.deepspeed.offload_optimizer)

    def __str__(self) -> str:
        return f"ZeRO-{self.stage}"

    @property
    def partitioned(self) -> bool:
        """ZeRO-3: every parameter is split across the ranks and gathered around its own module's
        forward only. A whole-model state dict is then a collective, a compiled block must be a leaf
        of the gather hooks, and a parameter read outside its module's forward must be declared."""
        return self.stage == 3

    @property
    def wraps_optimizer(self) -> bool:
        """ZeRO 1-3: DeepSpeed's ZeRO optimizer wraps ours (it guards, clips and measures the norm, and
        creates its fp32 partitions without stepping); stage 0 hands ours the raw gradients."""
        return self.stage > 0

    @property
    def flat_optimizer_state(self) -> bool:
        """ZeRO 0-2: a rank's optimizer file holds ``base_optimizer_state`` over flat fp32 partitions
        per group; ZeRO-3 writes its own layout (``fp32_flat_groups``)."""
        return self.stage <= 2

    @property
    def bf16_optimizer(self) -> bool:
        """Whether bf16 training at this ZeRO stage runs DeepSpeed's ``BF16_Optimizer`` (``data_types.
        grad_accum_dtype: fp32`` at ZeRO-1 without offload) instead of its ZeRO optimizer.

        Why (issue 45, the first H200 profile: ~300 ``isfinite`` per pythia-160m step and a host sync):
        under bf16 DeepSpeed 0.19's ZeRO optimizer skips a non-finite step only through
        ``bf16.check_grad_overflow``, a reduction and test per gradient tensor plus a sync, before it
        computes the global norm that clipping needs anyway; switched off, a non-finite gradient is
        applied (the weights become NaN) because that flag also gates the norm's own test. The
        ``BF16_Optimizer`` has no per-tensor pass: the one global norm decides (a non-finite norm skips
        the step and clears the gradients), and it keeps fp32 master weights and accumulates gradients
        in fp32 (what ZeRO-1 reduces in bf16). Its checkpoints (``bf16_zero_pp_rank_*``) resume exactly
        and re-partition like ZeRO-1's. DeepSpeed builds it for stage 1 only; ``deepspeed.extra:
        {data_types: {grad_accum_dtype: bf16}}`` selects the ZeRO optimizer again."""
        return self.stage == 1 and not self.offload

    def config(self, on_gpu: bool) -> dict[str, Any]:
        """DeepSpeed's ``zero_optimization`` section."""
        zero: dict[str, Any] = {"stage": self.stage}
        if self.offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
        return zero


def use_bf16(recipe: Any, on_gpu: bool) -> bool:
    """``train.precision``: auto = bf16 on GPU, fp32 on CPU."""
    p = recipe.train.precision
    return p == "bf16" or (p == "auto" and on_gpu)


def guard_in_optimizer(recipe: Any, on_gpu: bool) -> bool:
    """Stage 0 fp32: DeepSpeed hands our optimizer the raw gradients, so it must guard them."""
    return not Zero.of(recipe).wraps_optimizer and not use_bf16(recipe, on_gpu)


def deepspeed_config(recipe: Any, on_gpu: bool) -> dict[str, Any]:
    """The DeepSpeed config for ``recipe``; ``deepspeed.extra`` is merged in last."""
    t, ds, zero = recipe.train, recipe.deepspeed, Zero.of(recipe)
    bf16 = use_bf16(recipe, on_gpu)
    cfg: dict[str, Any] = {
        "train_batch_size": recipe.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": recipe.grad_accum_steps,
        # stage 0 fp32: GuardedAdamW clips (and reports the pre-clip norm); see the module doc
        "gradient_clipping": 0.0 if guard_in_optimizer(recipe, on_gpu) else t.grad_clip,
        "zero_optimization": zero.config(on_gpu),
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,  # our torch AdamW (subclass) under ZeRO
        "steps_per_print": 2**62,  # we log ourselves
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["bf16"]["check_grad_overflow"] = True  # ZeRO-2/3: what skips a non-finite step under bf16
        if zero.bf16_optimizer:
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}  # -> DeepSpeed's BF16_Optimizer
    return deep_merge(cfg, ds.extra)
