"""lm-eval's progress bars off while it runs (issue 46 item 10): the bars it draws while building each
task's requests (and while checking its request cache) are tqdm's, written between ncpctl's own
lines on stderr, three or more per evaluation and one per in-loop evaluation in the middle of the
training display. tqdm reads ``TQDM_DISABLE`` once, when it is imported, so the bars are turned off
by substituting a disabled tqdm where lm-eval looks it up, for the duration of the call only."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    import tqdm
    from lm_eval.api import model as api_model, task as api_task

    quiet = functools.partial(tqdm.tqdm, disable=True)
    # where lm-eval imported it at module level (not the tqdm module itself: a class deriving from
    # tqdm.tqdm while this runs would derive from the partial)
    saved = [(m, getattr(m, "tqdm")) for m in (api_task, api_model)]
    try:
        for m, _ in saved:
            m.tqdm = quiet
        yield
    finally:
        for m, orig in saved:
            m.tqdm = orig
