"""What the runtime LoRA update accepts from a client: the request body's shape and which files it may name.

The operator allows directories (``lora_update_dirs``); a client names LoRA files with the ``lora_path`` entries of
the load (``[COMPONENT=]PATH[@SCALE]``). An entry is accepted only if

1. its path is absolute and, as written (``..`` collapsed, nothing on disk looked at), lies under an allowed
   directory -- so a path outside is refused before anything outside is touched, and the answer is the same whether
   something exists there or not;
2. its real path (every symlink resolved) lies under an allowed directory's real path -- a symlink inside that leads
   outside is refused with the same answer;
3. it is a regular file with one name (``st_nlink == 1``): a hard link is a second name of a file that may live
   outside, and nothing can tell where its other names are.

What passes goes to the workers as ``(component, real path, scale)``: the workers open the real path, not the name the
client gave. Errors are one line; they repeat the entry as the client wrote it and never a resolved path.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_diffusion_plugin.engine.config import split_lora_entry

WORKER_METHOD = "diffusion_hsdp_loras"
"""The diffusion workers' method the API server calls through vllm-omni's ``collective_rpc`` (``patch_lora_update``)."""
RESULT_KEY = "diffusion_hsdp_loras"
"""Marks a worker's answer as ours (vllm-omni answers an RPC it could not run with a dict of its own)."""

MAX_ENTRIES = 64
MAX_ENTRY_CHARS = 4096
MAX_BODY_BYTES = 1 << 20
BODY_KEY = "lora_path"


class BadUpdate(ValueError):
    """The request is malformed or names a file that cannot be a LoRA (HTTP 400)."""


class PathRefused(PermissionError):
    """The entry names a file outside the allowed directories, or one with other names (HTTP 403)."""


@dataclass(frozen=True)
class UpdateEntry:
    """One accepted ``lora_path`` entry."""

    text: str
    """As the client wrote it (errors repeat it)."""
    component: str | None
    path: str
    """The file's real path: what the workers open."""
    scale: float | None
    """``@SCALE``, or None (the load's ``lora_scale``); the workers multiply it by ``lora_scale`` as at load."""

    def as_rpc(self) -> list:
        return [self.component, self.path, self.scale]


def allowed_dirs(dirs: Sequence[str], *, origin: str = "lora_update_dirs") -> tuple[str, ...]:
    """The real paths of the operator's directories, or raise naming one that is not an absolute path to an
    existing directory (at startup, before any worker starts)."""
    found = []
    for raw in dirs:
        if not os.path.isabs(raw):
            raise ValueError(f"{origin} entry {raw!r} is not an absolute path")
        if not os.path.isdir(raw):
            raise ValueError(f"{origin} entry {raw!r} is not an existing directory")
        found.append(os.path.realpath(raw))
    return tuple(found)


def parse_body(body: bytes) -> list[str]:
    """The ``lora_path`` entries of a request body ``{"lora_path": ["[COMPONENT=]PATH[@SCALE]", ...]}`` (an empty
    list: no LoRA), or raise :class:`BadUpdate` saying what is wrong with it."""
    if len(body) > MAX_BODY_BYTES:
        raise BadUpdate(f"the request body is {len(body)} bytes; at most {MAX_BODY_BYTES}")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadUpdate(f"the request body is not JSON ({type(exc).__name__} at {getattr(exc, 'pos', '?')})") \
            from None
    if not isinstance(data, dict) or set(data) != {BODY_KEY}:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise BadUpdate(f'the request body must be {{"{BODY_KEY}": ["[COMPONENT=]PATH[@SCALE]", ...]}}, got {keys}')
    entries = data[BODY_KEY]
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise BadUpdate(f"{BODY_KEY} must be a list of strings ([] for no LoRA)")
    if len(entries) > MAX_ENTRIES or any(len(e) > MAX_ENTRY_CHARS for e in entries):
        raise BadUpdate(f"{BODY_KEY} holds at most {MAX_ENTRIES} entries of at most {MAX_ENTRY_CHARS} characters")
    return entries


def split_entry(text: str) -> tuple[str | None, str, float | None]:
    """``(component, path, scale)`` of ``[COMPONENT=]PATH[@SCALE]`` without looking at the disk (``LoraSpec.parse``'s
    rules through ``config.split_lora_entry``, except that an ``@`` whose tail is no number always belongs to the file
    name)."""
    try:
        component, path, tail = split_lora_entry(text)
    except ValueError as exc:
        raise BadUpdate(f"lora_path entry: {exc}") from None
    scale = None
    if tail is not None:
        try:
            path, scale = path[:-len(tail) - 1], float(tail)
        except ValueError:
            pass  # an '@' that is part of the file name
    if scale is not None and not math.isfinite(scale):
        raise BadUpdate(f"lora_path entry {text!r}: the scale {tail!r} is not a finite number")
    return component, path, scale


def _under(path: str, dirs: Sequence[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip(os.sep) + os.sep) for d in dirs)


def check_entry(text: str, allowed: Sequence[str], *, configured: Sequence[str] = ()) -> UpdateEntry:
    """The entry accepted (see the module doc), or :class:`PathRefused` / :class:`BadUpdate`. ``allowed``: the real
    paths of the allowed directories (:func:`allowed_dirs`); ``configured``: the same directories as the operator
    wrote them (a client may name a file through either)."""
    component, path, scale = split_entry(text)
    if not path or not os.path.isabs(path):
        raise BadUpdate(f"lora_path entry {text!r}: the path must be absolute")
    refused = PathRefused(f"lora_path entry {text!r} is not a file under a directory this server allows "
                          f"(lora_update_dirs)")
    written = os.path.normpath(path)
    if not _under(written, [*allowed, *(os.path.normpath(d) for d in configured)]):
        raise refused
    real = os.path.realpath(written)
    if not _under(real, allowed):
        raise refused
    try:
        info = os.stat(real)
    except FileNotFoundError:
        raise BadUpdate(f"lora_path entry {text!r}: no such file") from None
    except OSError as exc:
        raise BadUpdate(f"lora_path entry {text!r}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise BadUpdate(f"lora_path entry {text!r} is not a regular file")
    if info.st_nlink != 1:
        raise PathRefused(f"lora_path entry {text!r} has {info.st_nlink} names (hard links); another may lie "
                          f"outside the allowed directories: give the server a copy")
    return UpdateEntry(text=text, component=component, path=str(Path(real)), scale=scale)


def check_entries(entries: Sequence[str], allowed: Sequence[str], *, configured: Sequence[str] = ()) \
        -> list[UpdateEntry]:
    return [check_entry(text, allowed, configured=configured) for text in entries]
