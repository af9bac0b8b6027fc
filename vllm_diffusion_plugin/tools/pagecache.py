"""A checkpoint's pages in the page cache: how many are resident (``mincore``), and evicting them
(``posix_fadvise(POSIX_FADV_DONTNEED)`` per file), for cold-storage startup measurements.

Eviction is per file, so other processes' cached files stay (``/proc/sys/vm/drop_caches`` would drop the whole
host's cache, which on a shared host changes everyone's timings). DONTNEED leaves pages that a live process
still maps: evict between servers, when none is running, and check with :func:`resident_bytes`. Linux only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

_PAGE = mmap.PAGESIZE


def files_under(paths: Iterable[Path]) -> list[Path]:
    """Every regular file of ``paths`` (files, or folders walked recursively), sorted."""
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found += [p for p in path.rglob("*") if p.is_file()]
        elif path.is_file():
            found.append(path)
    return sorted(set(found))


def evict(paths: Iterable[Path]) -> int:
    """``posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)`` on every file of ``paths`` (after an ``fdatasync``, as
    dirty pages are not dropped); returns the number of files."""
    files = files_under(paths)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    return libc


def resident_file_bytes(path: Path) -> int:
    """Bytes of ``path`` resident in the page cache (``mincore`` on a read-only shared mapping, which touches no
    page), rounded to whole pages."""
    size = Path(path).stat().st_size
    if size == 0:
        return 0
    libc = _libc()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + _PAGE - 1) // _PAGE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return min(size, sum(b & 1 for b in vec) * _PAGE)
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def resident_bytes(paths: Iterable[Path]) -> tuple[int, int]:
    """``(resident bytes, total bytes)`` of every file of ``paths``."""
    files = files_under(paths)
    return sum(resident_file_bytes(p) for p in files), sum(p.stat().st_size for p in files)
