"""A read-only FUSE passthrough of SRC at MOUNT that sleeps ``--latency-ms`` before serving each read request: a
latency-bound store (network storage) on one host. Multithreaded unless ``--single``, so parallel readers overlap
their waits; ``--max-read`` caps the bytes per request, so a tensor takes many requests. Needs fusepy (the
``bench`` extra) and libfuse2 (``apt-get install fuse libfuse2``). Runs in the foreground until unmounted
(``fusermount -u MOUNT``).

    python benchmarks/latency_fs.py SRC MOUNT [--latency-ms 4] [--max-read 131072] [--single]
"""

from __future__ import annotations

import argparse
import errno
import os
import time

from fuse import FUSE, FuseOSError, Operations


class LatencyPassthrough(Operations):
    """Read-only passthrough; every ``read`` waits ``latency_s`` first (``pread``: no shared file offset)."""

    def __init__(self, root: str, latency_s: float):
        self.root = os.path.realpath(root)
        self.latency_s = latency_s

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def getattr(self, path, fh=None):
        try:
            st = os.lstat(self._full(path))
        except OSError as err:
            raise FuseOSError(err.errno) from err
        return {key: getattr(st, key) for key in ("st_mode", "st_size", "st_nlink", "st_uid", "st_gid",
                                                   "st_atime", "st_mtime", "st_ctime")}

    def readdir(self, path, fh):
        return [".", ".."] + os.listdir(self._full(path))

    def open(self, path, flags):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise FuseOSError(errno.EROFS)
        return os.open(self._full(path), os.O_RDONLY)

    def read(self, path, size, offset, fh):
        time.sleep(self.latency_s)
        return os.pread(fh, size, offset)

    def release(self, path, fh):
        os.close(fh)
        return 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("mount")
    parser.add_argument("--latency-ms", type=float, default=4.0)
    parser.add_argument("--max-read", type=int, default=128 << 10)
    parser.add_argument("--single", action="store_true", help="serve one request at a time")
    args = parser.parse_args(argv)
    FUSE(LatencyPassthrough(args.src, args.latency_ms / 1000), args.mount, foreground=True, ro=True,
         nothreads=args.single, max_read=args.max_read, max_readahead=args.max_read, big_writes=False)


if __name__ == "__main__":
    main()
