"""Data-parallel scoring under a launcher (issue 47 item 5): ``deepspeed --num_gpus N $(which ncpctl)
eval ...``, ``torchrun --nproc_per_node N -m ncpctl eval ...`` or one process per device with
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set.

lm-eval does the sharding: with an LM whose ``rank``/``world_size`` say so, every task's documents
are dealt out round-robin (document i to rank i mod N), each rank answers its share, the ranks with
fewer requests repeat their last one so that every rank runs as many batches, and rank 0 gathers
the per-example scores and logged samples and computes the metrics over all of them. This module
gives ``NCPLM`` the collectives lm-eval calls (``all_gather``, ``gather_object``, ``barrier``), on
``torch.distributed`` directly (gloo on the CPU, NCCL on GPUs): no DeepSpeed engine is built and
no weights are sharded, each rank holds the whole model. ``ncpctl.evaluate.lm.NCPLM`` sums its
per-task token statistics over the ranks (``gather_stats``) and counts a repeated request once, so
rank 0's results equal one process's (log-likelihoods summed in another order: equal to ~1e-6).

The in-loop evaluation of a training run (``ncpctl.train.downstream``) does not shard: under ZeRO-3
every rank must run the same forwards (each layer's parameters are gathered by all ranks at once).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0


def launched() -> Ranks:
    """This process's place under a launcher (a world of one without one)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Ranks()
    return Ranks(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))


def init(ranks: Ranks) -> str:
    """Join the launcher's process group (once); returns the device this rank scores on."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = f"cuda:{ranks.local_rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(ranks.local_rank)
    if ranks.world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=ranks.rank, world_size=ranks.world)
    return device


class Collectives:
    """What lm-eval's evaluator calls on a data-parallel LM (``lm_eval.api.model.LM``'s no-ops for one
    process). Expects ``_rank``, ``_world_size`` and ``device``."""

    _rank: int
    _world_size: int
    device: Any

    def all_gather(self, tensor):
        """(world,) tensor of every rank's scalar (lm-eval gathers each rank's request count)."""
        if self._world_size <= 1:
            return tensor
        import torch
        import torch.distributed as dist

        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0):
        if self._world_size <= 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank (every rank gets the answer): a failure on one rank is
        raised on all of them, not left to hang the others in their next collective."""
        if self._world_size <= 1:
            return flag
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(flag)], device=self.device)  # NCCL reduces device tensors only
        dist.all_reduce(t)
        return bool(t.item() > 0)


def sum_stats(parts: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per-task token statistics (``NCPLM.token_stats``) of several ranks, summed."""
    out: dict[str, dict[str, float]] = {}
    for part in parts:
        for task, st in part.items():
            acc = out.setdefault(task, {})
            for k, v in st.items():
                acc[k] = acc.get(k, 0) + v
    return out
