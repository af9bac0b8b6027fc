"""The runtime LoRA update's patch units on the real vllm-omni: the API server's app gets ``/v1/diffusion_hsdp/loras``
only with ``lora_update_dirs``; a directory that is not there stops the server before any worker starts; the diffusion
workers have the method the routes call, and it answers (never raises) on a worker whose load was not ours."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
from omni_support import import_omni

from vllm_diffusion_plugin.doors.omni import _patching, lora_routes
from vllm_diffusion_plugin.doors.omni.lora_policy import RESULT_KEY, WORKER_METHOD

import_omni()  # skips this module where vllm-omni is not installed

FLAG = "diffusion-hsdp"


def stage_fields(**engine_args):
    from vllm_omni.config.omni_config import extract_diffusion_stage_config_kwargs

    engine_args.setdefault("model", "/nonexistent-model")
    engine_args.setdefault("dtype", "float32")
    return extract_diffusion_stage_config_kwargs(engine_args, stage_id=0)


def test_a_missing_update_dir_stops_the_api_server_before_any_worker(omni, tmp_path):
    with pytest.raises(ValueError, match=r"lora_update_dirs entry '/nonexistent/loras' is not an existing directory"):
        stage_fields(load_format=FLAG, additional_config={"diffusion_hsdp": {"lora_update_dirs": "/nonexistent/loras"}})
    fields = stage_fields(load_format=FLAG, additional_config={"diffusion_hsdp": {"lora_update_dirs": [str(tmp_path)]}})
    assert fields["additional_config"]["diffusion_hsdp"]["lora_update_dirs"] == [str(tmp_path)]
    assert _patching.status()["lora-update"] == "applied"


def test_the_workers_answer_the_update_without_raising(omni):
    from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker

    method = getattr(DiffusionWorker, WORKER_METHOD)
    assert _patching.is_patched(method)
    worker = types.SimpleNamespace(model_runner=None, od_config=types.SimpleNamespace(step_execution=False))
    for entries in (None, [[None, "/x.safetensors", None]]):
        answer = method(worker, entries)
        assert answer[RESULT_KEY] and answer["kind"] == "unsupported" and "diffusion-hsdp" in answer["error"]


APP_ROUTES = """
import json, sys
from vllm_diffusion_plugin import register
register()
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm_omni.entrypoints.openai import api_server
from vllm_diffusion_plugin.doors.omni import _patching
assert _patching.status()["lora-routes"] == "applied" and _patching.is_patched(api_server.build_openai_app)
app = api_server.build_openai_app(api_server.make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:]),
                                  ("generate",))
print("ROUTES=" + json.dumps(sorted({r.path for r in app.routes})))
"""


def routes_of(*argv: str, env: dict | None = None) -> set[str]:
    """The paths of the app vllm-omni's API server builds for ``vllm serve /models/wan --omni ARGV`` (a fresh process:
    vLLM resolves its platform once)."""
    child = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION_")}
    child |= {"VLLM_DIFFUSION_PLUGIN": "1", "VLLM_TARGET_DEVICE": "cpu", **(env or {})}
    proc = subprocess.run([sys.executable, "-c", APP_ROUTES, "/models/wan", *argv], capture_output=True, text=True,
                          env=child, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ROUTES=")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    return set(json.loads(line.removeprefix("ROUTES=")))


def test_vllm_omnis_app_gets_the_routes_only_when_dirs_are_set(omni, tmp_path):
    config = json.dumps({"diffusion_hsdp": {"lora_update_dirs": [str(tmp_path)]}})
    assert lora_routes.ROUTE in routes_of("--load-format", FLAG, "--additional-config", config)
    assert "/health" in (plain := routes_of("--load-format", FLAG)) and lora_routes.ROUTE not in plain
    assert lora_routes.ROUTE not in routes_of(env={"VLLM_DIFFUSION_LORA_UPDATE_DIRS": str(tmp_path)})  # not ours
