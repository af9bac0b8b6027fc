"""Patch (CPU platform only): vllm-omni's worker output thread packs results without a device stream.

Why. With more than one diffusion rank, vllm-omni runs each worker in a ``WorkerProc`` whose output thread
(``WorkerProc._async_output_loop``, ``diffusion/worker/diffusion_worker.py``) copies results to shared
memory on a side stream: ``torch.Stream(device=<current accelerator>, gpu_id)``. On a CPU-only host that
stream cannot be created (``torch.accelerator.current_accelerator()`` names the build's accelerator even
when there is none; "Backend doesn't support create a new Stream"), the thread dies before its first
item, rank 0 never answers, and startup hangs until ``--init-timeout`` (600 s by default). With a stream,
the copy would also need pinned host memory, which a CPU-only host does not have.

How. ``WorkerProc._async_output_loop`` is replaced by a loop with the same contract and no stream: it takes
``(output, async_output_id, event)`` items until ``None``, packs each output with vllm-omni's own
``pack_diffusion_output_shm(output)`` (its synchronous ``.cpu()`` path; tensors are host tensors already),
enqueues an ``OUTPUT_READY`` message (or one carrying the error, as the original does), and decrements the
pending counter that ``drain_async_outputs`` waits on. Installed only by ``CpuOmniPlatform`` (so only in
processes that resolved the CPU platform, i.e. under ``VLLM_DIFFUSION_OMNI_CPU=1``), never by ``register()``.

Versions. Recognized shape: vllm-omni 0.30.0, 0.31.0rc1 and 0.32.0rc1 (tested) (``WorkerProc._async_output_loop(self)`` creating a
``torch.Stream``; ``AsyncDiffusionOutput``, ``AsyncOutputKind.OUTPUT_READY`` and ``pack_diffusion_output_shm``
in the module). Anything else is skipped with a warning, and the CPU platform then refuses to start a
worker (``platform.require_patches_applied``) instead of hanging.

Remove when vllm-omni creates the side stream only where the platform has streams (or ships a CPU platform).
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni._patching import UnrecognizedShape, is_patched, mark, require_attr, require_params

logger = init_logger(__name__)

NAME = "cpu-output-stream"
TARGET = "vllm_omni.diffusion.worker.diffusion_worker"
ERROR_TEXT = "Background D2H/SHM packing failed"
"""The error text vllm-omni's own loop sends for a failed output (kept identical for its clients)."""


def apply(module: Any) -> str:
    where = module.__name__
    worker_proc = require_attr(module, "WorkerProc", where)
    original = require_attr(worker_proc, "_async_output_loop", f"{where}.WorkerProc")
    if is_patched(original):
        return "already applied"
    require_params(original, ("self",), f"{where}.WorkerProc._async_output_loop")
    kind = require_attr(require_attr(module, "AsyncOutputKind", where), "OUTPUT_READY", f"{where}.AsyncOutputKind")
    message_cls = require_attr(module, "AsyncDiffusionOutput", where)
    pack = require_attr(module, "pack_diffusion_output_shm", where)
    for name in ("_enqueue_result", "drain_async_outputs"):
        require_attr(worker_proc, name, f"{where}.WorkerProc")
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError) as exc:
        raise UnrecognizedShape(f"{where}.WorkerProc._async_output_loop: no source to check ({exc})") from exc
    if "torch.Stream(" not in source or "_async_output_pending" not in source:
        raise UnrecognizedShape(f"{where}.WorkerProc._async_output_loop no longer creates a torch.Stream "
                                "and counts pending outputs as 0.30 does")
    worker_proc._async_output_loop = mark(_host_output_loop(pack=pack, message_cls=message_cls, kind=kind),
                                          unit=NAME, original=original)
    return "applied"


def _host_output_loop(*, pack, message_cls, kind):
    def _async_output_loop(self) -> None:
        """vllm-omni's output thread without a device stream (vllm-diffusion-plugin CPU platform)."""
        while True:
            item = self._async_output_queue.get()
            if item is None:
                break
            output, async_output_id, _event = item  # host tensors: nothing to wait for
            try:
                pack(output)
                self._enqueue_result(message_cls(kind=kind, async_output_id=async_output_id, output=output))
            except Exception:
                logger.exception("Packing diffusion output %r failed; sending the error", async_output_id)
                self._enqueue_result(message_cls(kind=kind, async_output_id=async_output_id, error=ERROR_TEXT))
            finally:
                with self._async_output_done:
                    self._async_output_pending = max(0, self._async_output_pending - 1)
                    self._async_output_done.notify_all()

    return _async_output_loop
