"""One reachability check of the Hugging Face hub before hub tasks load (issue 46 item 7).

Without ``HF_HUB_OFFLINE``, an unreachable hub cost every hub task a minute of retries (five, one
warning line each, 1 + 2 + 4 + 8 + 8 s apart) before it failed. ``ncpctl eval`` instead asks the
hub once (a HEAD of its endpoint through huggingface_hub's own HTTP client, so proxies apply, a
5-second timeout); when that fails, the evaluation goes offline: datasets come from the local cache
only, a task whose data is not cached fails at once with its one line, and one line says why.
With ``HF_HUB_OFFLINE=1`` or ``HF_DATASETS_OFFLINE=1`` set, or no task that needs the hub, nothing
is asked.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from ncpctl.task_registry import leaves

TIMEOUT_S = 5.0
_answered = False  # the hub answered once in this process: not asked again
went_offline = False  # this process went offline because the hub did not answer


def offline() -> bool:
    return any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE") for k in ("HF_HUB_OFFLINE",
                                                                                  "HF_DATASETS_OFFLINE"))


def needs_hub(names: list[str], ours: dict[str, dict[str, Any]]) -> bool:
    """Whether a leaf task of ``names`` reads a hub dataset (ours that build their data locally,
    ``custom_dataset``, do not)."""
    return any(leaf not in ours or "custom_dataset" not in ours[leaf] for n in names for leaf in leaves(n, ours))


def unreachable() -> str | None:
    """Why the hub cannot be reached (None: it answered, whatever the status)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - any failure to get an answer means unreachable
        text = (str(e).strip().splitlines() or [""])[0][:120]
        return f"{type(e).__name__}: {text}" if text else type(e).__name__
    return None


def go_offline() -> None:
    """Offline mode from here on, in this process: the environment, and the flags huggingface_hub and
    datasets read from it when they were imported."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    if "huggingface_hub.constants" in sys.modules:
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True
    if "datasets.config" in sys.modules:
        cfg = sys.modules["datasets.config"]
        cfg.HF_HUB_OFFLINE = cfg.HF_DATASETS_OFFLINE = True


def check(names: list[str], ours: dict[str, dict[str, Any]], log: Callable[[str], None]) -> None:
    """Ask the hub once when a task needs it; unreachable: offline, with one line saying so."""
    global _answered, went_offline
    if _answered or offline() or not needs_hub(names, ours):
        return
    why = unreachable()
    if why is None:
        _answered = True
        return
    from huggingface_hub import constants

    go_offline()
    went_offline = True
    log(f"the Hugging Face hub ({constants.ENDPOINT}) is unreachable ({why}): hub datasets are read from the "
        "local cache only (HF_HUB_OFFLINE=1 skips this check)")
