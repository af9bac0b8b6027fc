"""Progress bars for long steps: tqdm on rank 0, only when stderr is a terminal.

``progress``, as every step takes it: True shows a bar, False never, None only for work over
``PROGRESS_MIN_BYTES`` (the library default: quiet for small loads and inside servers' logs). The CLI passes
True on a terminal and False under ``--json``.
"""

from __future__ import annotations

import os
import sys

PROGRESS_MIN_BYTES = 1 << 30


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def progress_bar(*, total: int, desc: str, progress: bool | None, unit: str = "B", size: int | None = None):
    """A tqdm bar, or None when none is to be shown. ``size``: bytes the work covers (for ``progress=None``;
    defaults to ``total`` when ``unit`` is bytes)."""
    size = total if size is None and unit == "B" else size or 0
    show = progress is True or (progress is None and size > PROGRESS_MIN_BYTES)
    if not show or total <= 0 or _rank() != 0 or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    scaled = dict(unit_scale=True, unit_divisor=1024) if unit == "B" else {}
    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, leave=False, **scaled)
