"""The runtime LoRA update's HTTP face in vllm-omni's API server: ``/v1/diffusion_hsdp/loras``.

- ``GET`` -> 200 ``{"loras": [{"component", "path", "scale", "sha256", "fused_at"}, ...]}``: the set every DiT serves.
- ``POST {"lora_path": ["[COMPONENT=]PATH[@SCALE]", ...]}`` (``[]``: no LoRA) -> 200 ``{"loras": [...], "seconds":
  ..., "report": {...}}`` once every diffusion worker fuses the new set; the entries mean what they mean in the load's
  ``lora_path`` (``@SCALE`` times ``lora_scale``, components assigned the same way).

Errors answer vLLM's error shape (``{"error": {"message", "type", "code"}}``, as ``/v1/load_lora_adapter``), the
message one line: 400 a malformed body, a missing file, a LoRA the engine refused before any weight changed (naming
the file; the old set still serves); 403 a path outside ``lora_update_dirs`` (``lora_policy``); 409 an update while
another runs, more than one API server process (the lock is this process's), or a server whose load cannot swap
(``hsdp_weight_load`` other than ``rank_local``, step execution: the request is fine, the server's state is what
conflicts); 500 a failure after weights began changing (or workers that did not answer, whose state is unknown): this
server stops (SIGTERM to itself, the cause in its log) and its workers refuse every request until it has -- it never
serves mixed weights (``lora_update`` says why it does not swap back).

The workers run the update as a control RPC of vllm-omni's diffusion engine (``lora_update``), between requests.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_diffusion_plugin import envs
from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni import lora_policy
from vllm_diffusion_plugin.doors.omni.lora_policy import RESULT_KEY, WORKER_METHOD
from vllm_diffusion_plugin.doors.omni.serve_options import omni_options
from vllm_diffusion_plugin.engine.session import LOAD_FORMAT

logger = init_logger(__name__)

ROUTE = "/v1/diffusion_hsdp/loras"
ERROR_TYPES = {400: "BadRequestError", 403: "PermissionDeniedError", 409: "ConflictError", 500: "InternalServerError"}
KIND_STATUS = {"refused": 400, "unsupported": 409, "failed": 500}


def error(code: int, message: str) -> JSONResponse:
    line = " ".join(str(message).split())  # one line, whatever the cause's text held
    return JSONResponse({"error": {"message": line, "type": ERROR_TYPES.get(code, "Error"), "code": code}},
                        status_code=code)


def terminate_server() -> None:
    """Stop this API server as Ctrl-C would (its engines and workers with it)."""
    os.kill(os.getpid(), signal.SIGTERM)


def diffusion_stages(engine_client: Any) -> list[int] | None:
    """The ids of the engine's diffusion stages (None: let the engine send to every stage)."""
    configs = getattr(engine_client, "stage_configs", None) or ()
    ids = [i for i, config in enumerate(configs) if getattr(config, "stage_type", None) == "diffusion"]
    return ids or None


def worker_results(results: Any) -> list[dict]:
    """Every worker answer of ours in vllm-omni's (nested: stages, replicas) RPC result; raise on anything else."""
    if isinstance(results, dict) and results.get(RESULT_KEY):
        return [results]
    if isinstance(results, (list, tuple)) and results:
        return [found for item in results for found in worker_results(item)]
    raise RuntimeError(f"a diffusion stage answered the LoRA update with {str(results)[:300]!r}")


class LoraRoutes:
    """The two routes, the lock that keeps updates from overlapping, and what to do when weights may be mixed."""

    def __init__(self, allowed: Sequence[str], configured: Sequence[str], *,
                 stop: Callable[[], None] = terminate_server) -> None:
        self.allowed, self.configured, self.stop = tuple(allowed), tuple(configured), stop
        self.lock = asyncio.Lock()

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route(ROUTE, self.current, methods=["GET"])
        router.add_api_route(ROUTE, self.update, methods=["POST"])
        return router

    async def _call(self, request: Request, entries: list | None) -> list[dict]:
        engine_client = request.app.state.engine_client
        results = await engine_client.collective_rpc(method=WORKER_METHOD, args=(entries,),
                                                     stage_ids=diffusion_stages(engine_client))
        return worker_results(results)

    async def current(self, request: Request) -> JSONResponse:
        try:
            answers = await self._call(request, None)
        except Exception as exc:  # the engine's error, one line
            return error(500, f"the diffusion workers did not answer: {type(exc).__name__}: {exc}")
        bad = [a for a in answers if not a.get("ok")]
        if bad:
            return error(KIND_STATUS.get(bad[0].get("kind"), 500), bad[0].get("error"))
        return JSONResponse({"loras": answers[0]["loras"]})

    async def update(self, request: Request) -> JSONResponse:
        try:
            entries = lora_policy.check_entries(lora_policy.parse_body(await request.body()), self.allowed,
                                                configured=self.configured)
        except lora_policy.PathRefused as exc:
            logger.warning("runtime LoRA update refused (403): %s", exc)
            return error(403, str(exc))
        except lora_policy.BadUpdate as exc:
            return error(400, str(exc))
        if getattr(request.app.state, "api_server_count", 1) != 1:
            return error(409, "the runtime LoRA update needs a single API server process (--api-server-count 1): "
                              "its lock is this process's")
        if self.lock.locked():
            return error(409, "another LoRA update is running; send this one when it answered")
        async with self.lock:
            logger.info("runtime LoRA update: %d file(s): %s", len(entries), ", ".join(e.text for e in entries))
            try:
                answers = await self._call(request, [e.as_rpc() for e in entries])
            except Exception as exc:  # the workers may have changed weights: their state is unknown
                return self._mixed(f"the diffusion workers did not answer the LoRA update "
                                   f"({type(exc).__name__}: {exc})")
            return self._answer(answers)

    def _answer(self, answers: list[dict]) -> JSONResponse:
        worst = next((a for a in answers if a.get("kind") == "failed"), None) or \
            next((a for a in answers if not a.get("ok")), None)
        if worst is None:
            first = answers[0]
            logger.info("runtime LoRA update done in %.2f s: %s", first.get("seconds", float("nan")),
                        ", ".join(f"{x['component']}={x['path']}@{x['scale']}" for x in first["loras"]) or "no LoRA")
            return JSONResponse({"loras": first["loras"], "seconds": first.get("seconds"),
                                 "report": first.get("report")})
        kind, message = worst.get("kind"), worst.get("error") or "no cause given"
        if kind == "failed":
            return self._mixed(message)
        return error(KIND_STATUS.get(kind, 500), message)

    def _mixed(self, cause: str) -> JSONResponse:
        logger.error("runtime LoRA update failed after weights began changing: the DiTs may hold mixed weights, so "
                     "this server stops (its workers refuse every request until then). Cause: %s", cause)
        self.stop()
        return error(500, f"{cause}; the DiTs may hold mixed weights: the server stops")


def update_dirs(args: Any) -> tuple[str, ...]:
    """The ``lora_update_dirs`` of a server started with ``args`` (vLLM's parsed command line): empty unless its load
    format is ours."""
    if str(getattr(args, "load_format", "") or "").lower() != LOAD_FORMAT:
        if envs.is_set("VLLM_DIFFUSION_LORA_UPDATE_DIRS"):
            logger.warning("VLLM_DIFFUSION_LORA_UPDATE_DIRS is set, but this server's load format is not "
                           "%s: it has no runtime LoRA update", LOAD_FORMAT)
        return ()
    additional = getattr(args, "additional_config", None) or {}
    if isinstance(additional, str):
        additional = json.loads(additional)
    return omni_options(additional).lora_update_dirs


def add_routes(app: Any, args: Any) -> bool:
    """``app`` (vllm-omni's FastAPI app) gets the routes when ``args`` enable them; whether it did."""
    dirs = update_dirs(args)
    if not dirs:
        return False
    app.include_router(LoraRoutes(lora_policy.allowed_dirs(dirs), dirs).router())
    logger.warning("runtime LoRA update enabled: %s reads LoRA files from %s (lora_update_dirs); anyone who can "
                   "reach this server can change the LoRAs it serves", ROUTE, ", ".join(dirs))
    return True
