"""The runtime LoRA update on vllm-omni's diffusion workers: what a worker keeps from its load, and what it runs.

After the load, ``keep`` leaves on the pipeline vllm-omni serves what a swap needs: the worker's load session and,
under ``hsdp_weight_load=rank_local``, the ``RowLoad`` of each DiT (its traced row bindings, its shards). The API
server's ``POST /v1/diffusion_hsdp/loras`` (``lora_routes``) reaches every worker through vllm-omni's
``collective_rpc`` as the worker method ``diffusion_hsdp_loras`` (``patch_lora_update``), which calls :func:`run`.

Between requests. vllm-omni's ``DiffusionEngine.collective_rpc`` does not call the workers itself once its busy loop
runs: it queues the call, and the busy loop drains that queue between two ``execute_fn`` calls -- the same thread that
runs every batch (``_process_rpc_queue``; ``/v1/omni/sleep`` reaches the workers the same way). In request-level
execution one ``execute_fn`` runs a batch of requests from the first step to the decoded output, so a request in flight
finishes on the old weights, the swap runs with no request on the workers, and the next batch starts on the new set.
Under step execution (``--step-execution``, streaming output) a request spans several ``execute_fn`` calls and a swap
could land between two of its steps: :func:`run` refuses it there.

All ranks or none. Every rank runs :func:`run` with the same entries (one broadcast RPC), and the session's
``swap_loras`` agrees on the outcome across ranks: a refusal (``LoraSwapRefused``: found before any weight changed)
leaves the old set serving on every rank; a failure after the first write (``LoraSwapFailed``, on one rank or all)
fails it on all. Then the pipeline may hold part of the old set and part of the new, and the old one cannot be put back
by swapping back: a swap re-reads the modules the fused set and the requested set touch, and the failed attempt may
have written modules only its own set touches. So the worker's pipeline refuses every request from then on (its
``forward`` raises naming the cause) and the API server stops (``lora_routes``): no request ever runs on mixed weights;
a restart loads whichever set the operator names.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni.lora_policy import RESULT_KEY
from vllm_diffusion_plugin.engine.session import LoadSession, LoraSpec, LoraSwapFailed, LoraSwapRefused, RowLoad

logger = init_logger(__name__)

STATE_ATTR = "_diffusion_hsdp_swap"
"""The attribute of the served pipeline holding its :class:`SwapState`."""
SWAPPABLE = ("rank_local",)
"""The weight-load strategies whose row bindings a swap re-reads under vllm-omni."""


@dataclass
class SwapState:
    """What a worker keeps of its load for the runtime LoRA update."""

    session: LoadSession
    strategy: str
    rows: dict[str, RowLoad] = field(default_factory=dict)
    """Component -> the ``RowLoad`` the load used (``rank_local`` only)."""
    broken: str | None = None
    """Why the pipeline refuses requests: a failed swap whose restore failed too."""


def keep(model: nn.Module, session: LoadSession, *, strategy: str, rows: Mapping[str, RowLoad] | None = None) -> None:
    """Leave on ``model`` (the pipeline vllm-omni serves) what a swap needs; ``rows`` add to what is there."""
    state = getattr(model, STATE_ATTR, None)
    if state is None or state.session is not session:
        state = SwapState(session, strategy)
        object.__setattr__(model, STATE_ATTR, state)  # not a submodule: nn.Module's bookkeeping stays out of it
    state.strategy = strategy
    state.rows.update(rows or {})


def state_of(model: Any) -> SwapState | None:
    return getattr(model, STATE_ATTR, None)


def answer(ok: bool, kind: str, *, error: str | None = None, **fields: Any) -> dict[str, Any]:
    return {RESULT_KEY: True, "ok": ok, "kind": kind, "error": error, **fields}


def specs_of(entries: Sequence[Sequence[Any]], default_scale: float) -> list[LoraSpec]:
    """``(component, path, scale)`` triples from the API server (``lora_policy.UpdateEntry.as_rpc``) as the load's
    specs: ``@SCALE`` times ``lora_scale``, as ``LoraSpec.parse`` does."""
    return [LoraSpec(Path(path), default_scale if scale is None else float(scale) * default_scale, component)
            for component, path, scale in entries]


def _refuse_requests(model: nn.Module, cause: str) -> None:
    def forward(*args, **kwargs):
        raise RuntimeError(f"diffusion-hsdp: this pipeline's DiTs may hold mixed LoRA weights after a failed runtime "
                           f"LoRA update ({cause}); it serves no request: restart the server")

    object.__setattr__(model, "forward", forward)  # vllm-omni's runner calls pipeline.forward(batch)


def run(model: nn.Module, entries: Sequence[Sequence[Any]] | None, *, step_execution: bool) -> dict[str, Any]:
    """One worker's part of ``GET`` (``entries`` None) or ``POST`` (the new set) ``/v1/diffusion_hsdp/loras``: a
    JSON-able answer, never an exception (vllm-omni turns a worker's exception into a result of its own)."""
    state = state_of(model)
    if state is None:
        return answer(False, "unsupported", error="this server's DiTs were not loaded by --load-format "
                                                  "diffusion-hsdp, so it has no runtime LoRA update")
    if entries is None:
        return answer(True, "ok", loras=state.session.fused_loras())
    if state.broken:
        return answer(False, "failed", error=f"an earlier LoRA update left mixed weights: {state.broken}")
    if state.strategy not in SWAPPABLE or not state.rows:
        return answer(False, "unsupported", error=f"this server loaded its DiTs with hsdp_weight_load="
                      f"{state.strategy}; the runtime LoRA update needs hsdp_weight_load=rank_local (with --use-hsdp "
                      f"and 2 or more ranks): only it keeps the row bindings a swap re-reads")
    if step_execution:
        return answer(False, "unsupported", error="the runtime LoRA update needs request-level execution: under "
                                                  "step execution a request could see the swap between two steps")
    start = time.perf_counter()
    session = state.session
    try:
        report = session.swap_loras(specs_of(entries, session.options.lora_scale), dits=state.rows)
    except LoraSwapRefused as exc:  # before any weight changed, agreed by every rank: the old set serves
        return answer(False, "refused", error=str(exc))
    except Exception as exc:  # noqa: BLE001 (LoraSwapFailed, agreed by every rank; or anything after the first write)
        state.broken = str(exc) if isinstance(exc, LoraSwapFailed) else f"{type(exc).__name__}: {exc}"
        _refuse_requests(model, state.broken)
        logger.error("runtime LoRA update failed after weights began changing; this worker refuses every request "
                     "from now on: %s", state.broken)
        return answer(False, "failed", error=state.broken)
    seconds = time.perf_counter() - start
    logger.info("runtime LoRA update: %d file(s) fused in %.2f s", len(entries), seconds)
    return answer(True, "ok", loras=session.fused_loras(), report=report.as_dict(), seconds=seconds)
