"""Checkpoint bytes into memory so that a failing store is an error naming the file and the byte, never a SIGBUS.

A tensor viewing a mapped file (``weights._mapped_file``) is read by touching its pages: where the store fails that
read (a FUSE or network file system answering EIO) the kernel kills the process with SIGBUS, naming nothing.
:func:`fault_in` reads the pages in first, by ``madvise(MADV_POPULATE_READ)`` (Linux 5.14+), which returns the error
instead; on a kernel without it (EINVAL) it reads the tensor's bytes with ``pread`` into a tensor of its own, which
returns the error too. :func:`pread_into` is the one ``pread`` loop every reader uses (``rank_local``'s rows, staged
copies, this fallback).

What stays a SIGBUS: a page read in here and evicted before the consumer's copy touches it, and a file truncated
under its mapping (``engine.io.integrity`` names the file when the rank survives to check it).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import sys

import torch

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.errors import CheckpointError

logger = init_logger(__name__)

_MADV_POPULATE_READ = 22  # Linux 5.14+: fault pages in, an I/O error returned as EFAULT instead of a SIGBUS
_populate = {"works": sys.platform.startswith("linux")}


def pread_into(fd: int, offset: int, dst: torch.Tensor, file) -> None:
    """Fill the contiguous CPU tensor ``dst`` with the file's bytes at ``offset`` (no mmap, no extra copy); an
    I/O error names the file and the byte it failed at."""
    view = memoryview(dst.detach().view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise CheckpointError(f"{file}: {exc.strerror or exc} reading {len(view) - done} bytes at byte "
                                  f"{offset + done} (errno {exc.errno})") from exc
        if n <= 0:
            raise CheckpointError(f"{file}: unexpected end of file at byte {offset + done} (truncated since it "
                                  f"was resolved?)")
        done += n


def pread_tensor(file, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A new contiguous CPU tensor shaped and typed like ``like``, holding ``file``'s bytes from ``offset``."""
    out = torch.empty(like.shape, dtype=like.dtype)
    fd = os.open(file, os.O_RDONLY)
    try:
        pread_into(fd, offset, out, file)
    finally:
        os.close(fd)
    return out


def fault_in(tensor: torch.Tensor, file=None, offset: int | None = None) -> torch.Tensor | None:
    """Read every page of a tensor viewing a mapped file into memory, so the consumer's copy finds it there.

    On Linux 5.14+ with ``madvise(MADV_POPULATE_READ)``: an I/O error under the mapping (a store failing a read)
    raises ``OSError`` naming the byte offset in the file (the mapping starts at byte 0), where touching the pages
    would kill the process with SIGBUS; returns None. Without it (an older kernel: EINVAL), given the mapped
    ``file`` and the tensor's byte ``offset`` in it: the tensor's bytes read with ``pread`` into a new tensor, which
    is returned for the caller to use instead (an I/O error named by :func:`pread_into`). Else one byte per page is
    touched (a failing store then is a SIGBUS)."""
    if tensor.numel() == 0 or not tensor.is_contiguous():
        return None
    if _populate["works"]:
        start = tensor.data_ptr()
        if _madvise_populate(start, tensor.numel() * tensor.element_size()) == 0:
            return None
        failed = ctypes.get_errno()
        if failed in (errno.EFAULT, errno.EIO):  # a page-in that touching would have answered with SIGBUS
            raise OSError(errno.EIO, f"I/O error under the mapping at byte {_first_bad_byte(tensor)} (a read of "
                                     f"the file failed)")
        if failed in (errno.EINVAL, errno.ENOSYS):  # an older kernel: pread (or touch) from now on
            _populate["works"] = False
            logger.info("madvise(MADV_POPULATE_READ) is not available here (%s): mapped checkpoint tensors are read "
                        "with pread", errno.errorcode.get(failed, failed))
        elif file is None:  # EINTR, ENOMEM, EAGAIN: touch them this time
            _touch(tensor)
            return None
    if file is not None and offset is not None:
        return pread_tensor(file, offset, tensor)
    _touch(tensor)
    return None


def _touch(tensor: torch.Tensor) -> None:
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    flat[::mmap.PAGESIZE].max()  # one byte per page: the kernel reads the page (and its readahead) here
    flat[-1].item()  # the last page, when the bytes do not start on a page boundary


def _madvise_populate(address: int, length: int) -> int:
    libc = _libc()
    page = address - address % mmap.PAGESIZE
    return libc.madvise(ctypes.c_void_p(page), ctypes.c_size_t(length + address - page), _MADV_POPULATE_READ)


def _first_bad_byte(tensor: torch.Tensor) -> int:
    """The file offset of the first page of ``tensor`` that cannot be read in (only after a failed populate)."""
    base = tensor.storage_offset() * tensor.element_size()  # the storage maps the file from byte 0
    start, length = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    first = start - start % mmap.PAGESIZE
    step = 1 << 20
    for chunk in range(first, start + length, step):  # MiB by MiB, then page by page: only on this error path
        if _madvise_populate(chunk, min(step, start + length - chunk)) != 0:
            for page in range(chunk, min(chunk + step, start + length), mmap.PAGESIZE):
                if _madvise_populate(page, mmap.PAGESIZE) != 0:
                    return base + max(0, page - start)
    return base


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
