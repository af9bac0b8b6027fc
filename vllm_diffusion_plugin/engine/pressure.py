"""Memory pressure while a load and a server's first run go on: a host that thrashes, said while it happens.

The pre-flight holds the planned peaks against what the node has when the load starts. Other processes can take
memory after that; near the limit Linux reclaims file pages -- the processes' own code among them -- and reads them
again rather than kill anything, and a load or vllm-omni's warm-up run crawls for minutes (vllm-omni gives up after
600 s: "RPC call to execute_model timed out") with no word of why. :class:`PressureWatch` reads the kernel's
pressure stall information (``/proc/pressure/memory``, Linux 4.20+ built with PSI) every ``interval_s`` and, when
every non-idle task of the host stalled on memory for more than ``threshold`` percent of the last 10 s ("full
avg10"), logs one warning naming that share, what the host and the memory cgroup have left
(``preflight.host_available``) and what the watched work is; again only after the pressure fell below half the
threshold. Where PSI is missing it says so at debug level and stops. It never stops the work: a stall can end.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.memory import host_available, size_text

logger = init_logger(__name__)

THRESHOLD = 20.0
"""Percent of the last 10 s in which all non-idle tasks stalled on memory. A host at ease shows 0; a load under a
memory cgroup near its limit a few percent while the kernel drops its page cache; a thrashing host tens."""


def full_avg10(root: Path = Path("/")) -> float | None:
    """The "full avg10" of ``root/proc/pressure/memory`` (percent), None where the kernel has no PSI."""
    try:
        text = (root / "proc/pressure/memory").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("full "):
            fields = dict(item.split("=", 1) for item in line.split()[1:] if "=" in item)
            try:
                return float(fields["avg10"])
            except (KeyError, ValueError):
                return None
    return None


class PressureWatch(threading.Thread):
    """A daemon thread that warns while the host thrashes (see the module docstring); ``what``: the work watched,
    as the warning names it (``"rank 1's load"``)."""

    def __init__(self, what: str, *, threshold: float = THRESHOLD, interval_s: float = 2.0,
                 root: Path = Path("/")) -> None:
        super().__init__(name="vllm-diffusion-pressure", daemon=True)
        self.what, self.threshold, self.interval_s, self.root = what, threshold, interval_s, root
        self.warnings = 0
        self.in_episode = False
        """Warned, and the pressure has not yet fallen below half the threshold."""
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval_s):
            full = full_avg10(self.root)
            if full is None:
                logger.debug("no memory pressure figures (%s): not watched", self.root / "proc/pressure/memory")
                return
            if full >= self.threshold and not self.in_episode:
                host = host_available(self.root)
                left = f"{size_text(host.available)} left [{host.source}]" if host else "nothing readable left"
                logger.warning(
                    "memory pressure during %s: every task of this host stalled on memory %.0f%% of the last 10 s "
                    "(/proc/pressure/memory); %s. The host is reclaiming and re-reading pages rather than killing "
                    "anything: this may crawl until a timeout. Free memory on this host or lower the load's peak "
                    "(vllm-diffusion plan names each strategy's, the first run's included)", self.what, full, left)
                self.in_episode, self.warnings = True, self.warnings + 1
            elif self.in_episode and full < self.threshold / 2:
                self.in_episode = False

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=self.interval_s + 1)


@contextlib.contextmanager
def watching(what: str) -> Iterator[PressureWatch]:
    """A watch for the duration of the block."""
    watch = PressureWatch(what)
    watch.start()
    try:
        yield watch
    finally:
        watch.stop()


_watching: PressureWatch | None = None


def watch_process(what: str) -> PressureWatch:
    """The process's one watch, started on first call (a server worker's lives as long as the worker)."""
    global _watching
    if _watching is None or not _watching.is_alive():
        _watching = PressureWatch(what)
        _watching.start()
    return _watching
