"""What a local rank imports, imported once by the fork server the ranks are forked from (``rank_server``):
torch, torch.distributed and FSDP, the engine, the load door and -- when the server was started with
``VD_RANK_IMPORTS`` (``{"checkpoint": ..., "components": ...}``) -- the diffusers classes that checkpoint names, as the
launcher imports them (``cli.import_for_load``; diffusers without what a load never uses in any case). A rank then starts with all of it instead of importing it again (seconds each)."""

from __future__ import annotations

import json
import os

import torch.distributed.fsdp  # noqa: F401

from vllm_diffusion_plugin.doors import cli
from vllm_diffusion_plugin.doors.cli import load  # noqa: F401
from vllm_diffusion_plugin.doors.cli.rank_server import CLASSES_VARIABLE
from vllm_diffusion_plugin.engine import session


def _named_classes() -> None:
    try:
        wanted = json.loads(os.environ.get(CLASSES_VARIABLE) or "null")
    except ValueError:
        wanted = None
    if isinstance(wanted, dict) and isinstance(wanted.get("checkpoint"), str):
        cli.import_for_load(wanted["checkpoint"], wanted.get("components"))
    else:
        session.import_diffusers()


_named_classes()
