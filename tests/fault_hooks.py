"""The CLI with hooks the fault tests steer through the environment (every spawned rank runs this file's top level
too: it is the ranks' ``__main__``; under ``torchrun`` each rank runs it). Markers are JSON files in ``FAULT_DIR``
(``rank``, ``pid``, ``what``), written whole (a rename), so a test that sees one may act on it.

- ``FAULT_HOLD=R``: rank R, when it starts reading its own rows (``rank_local``), writes ``held-rankR.json`` and waits
  there, alive, never answering its peers (until it is killed or stopped);
- ``FAULT_MARK_COLLECTIVES=1``: each rank writes ``collective-rankR.json`` as it enters its first collective after
  its reads: the all-gather of an FSDP-sharded parameter (``DTensor.full_tensor``: ``--save-fused``) or the
  report's ``gather_object``;
- under ``torchrun`` (with ``FAULT_DIR``), each rank writes ``started-rankR.json`` as it starts;
- ``FAULT_MARK_START=1``: each local rank writes ``start-PID.json`` as it starts, before anything of its own is
  imported (this file is run as its ``__main__`` before the rank's function is unpickled): what it started with
  (``imported``: which of torch, the engine, the load door, diffusers' Wan transformer were already there).

    python tests/fault_hooks.py load DIR ...      (the arguments of ``vllm-diffusion``)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def mark(name: str, what: str) -> Path:
    rank = int(os.environ.get("RANK", "0"))
    path = Path(os.environ["FAULT_DIR"]) / f"{name}-rank{rank}.json"
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"rank": rank, "pid": os.getpid(), "what": what}))
        tmp.rename(path)
    return path


def mark_start() -> None:
    """``start-PID.json``: the modules this local rank started with (no ``RANK`` yet: the launcher sets it later)."""
    wanted = ("torch", "torch.distributed.fsdp", "vllm_diffusion_plugin.engine.session",
              "vllm_diffusion_plugin.doors.cli.load")
    imported = [name for name in wanted if name in sys.modules]
    if any("WanTransformer3DModel" in getattr(module, "__dict__", {}) for name, module in list(sys.modules.items())
           if name.startswith("diffusers.models.")):
        imported.append("WanTransformer3DModel")
    path = Path(os.environ["FAULT_DIR"]) / f"start-{os.getpid()}.json"
    tmp = path.with_name(f".{path.name}")
    tmp.write_text(json.dumps({"pid": os.getpid(), "parent": os.getppid(), "imported": imported}))
    tmp.rename(path)


def _hold(original):
    def hold(*args, **kwargs):
        if os.environ.get("RANK", "0") == os.environ["FAULT_HOLD"]:
            mark("held", "rank_local's read of its rows")
            while True:  # alive, answering no one
                time.sleep(0.1)
        return original(*args, **kwargs)

    return hold


def _marking(original, what: str):
    def marked(*args, **kwargs):
        mark("collective", what)
        return original(*args, **kwargs)

    return marked


if os.environ.get("FAULT_MARK_START") and __name__ == "__mp_main__":  # a local rank (the launcher is __main__)
    mark_start()
if os.environ.get("FAULT_DIR") and "TORCHELASTIC_RUN_ID" in os.environ:
    mark("started", "a torchrun worker")
if os.environ.get("FAULT_HOLD"):
    from vllm_diffusion_plugin.engine.strategies import rank_local

    rank_local._read_local_rows = _hold(rank_local._read_local_rows)
if os.environ.get("FAULT_MARK_COLLECTIVES"):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    DTensor.full_tensor = _marking(DTensor.full_tensor, "the all-gather of an FSDP-sharded parameter")
    dist.gather_object = _marking(dist.gather_object, "the report's gather_object")

if __name__ == "__main__":
    from vllm_diffusion_plugin.doors import cli

    sys.exit(cli.main(sys.argv[1:]))
