"""CPU threads on a shared machine (issue 46 item 1).

torch runs its intra-op work (GEMMs, elementwise kernels) on an OpenMP pool, by default one thread
per core. Between two parallel regions GNU OpenMP (the runtime of the CPU wheels) lets an idle
thread spin, waiting for the next region, instead of sleeping. On a machine whose cores other
processes also use, a spinning thread holds a core that the thread it waits for needs, and every
region ends at the pace of the scheduler: the demo's pretrain on 2 cores at load average 10-12
ran at 0.20-0.25 steps/s, against 2.3-2.9 with passive waiting (idle threads sleep) and 1.1-1.5
at one thread (docs/getting-started.md, "Threads on a busy machine"). Passive waiting costs a wake-up per region: on a quiet
machine the demo's steps run about a fifth slower (5.8 against 7.1 steps/s), a price worth the
collapse it prevents under load.

``OMP_WAIT_POLICY`` is read once, when the OpenMP runtime loads with torch: the CLI sets it first
thing (``prefer_passive_waiting``), before any import of torch, unless the user has set it. The
intra-op thread count stays torch's (or ``OMP_NUM_THREADS``): it changes the order of floating-
point sums, so a run records it (``record``: the checkpoint's ncpctl.json and the ``--json``
summary), and two runs are bit-identical only at the same count.
"""

from __future__ import annotations

import os
from typing import Any

WAIT_POLICY = "OMP_WAIT_POLICY"


def prefer_passive_waiting() -> None:
    """Idle OpenMP threads sleep instead of spinning, unless ``OMP_WAIT_POLICY`` is set already.
    Effective only before torch is imported in this process (and in the processes it starts)."""
    os.environ.setdefault(WAIT_POLICY, "PASSIVE")


def record() -> dict[str, Any]:
    """The threads this process computes with: ``intra_op`` (torch's pool, the count that changes
    the numerics) and ``wait_policy`` (null: the OpenMP runtime's default, spinning)."""
    import torch

    return {"intra_op": torch.get_num_threads(), "wait_policy": os.environ.get(WAIT_POLICY)}


def describe() -> str:
    """``2 threads (OMP_WAIT_POLICY=PASSIVE)``: the start-up line's words for ``record``."""
    r = record()
    return f"{r['intra_op']} thread{'s' * (r['intra_op'] != 1)} ({WAIT_POLICY}={r['wait_policy'] or 'unset'})"
