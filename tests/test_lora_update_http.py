"""The runtime LoRA update's HTTP layer (``/v1/diffusion_hsdp/loras``), in process, no model: the routes exist only
when ``lora_update_dirs`` is set; the path policy (403 without revealing what exists outside, ``..``, symlinks, hard
links); malformed bodies (400); one update at a time (409); and how each worker answer maps to a status -- a
failure after weights began changing stops the server. The workers are vllm-omni's ``collective_rpc`` seam, answered
here the way ``lora_update.run`` answers (``tests/serve/test_serve_lora_swap.py`` runs the real thing)."""

from __future__ import annotations

import asyncio
import json
import os
import types

import httpx
import pytest
from fastapi import FastAPI

from vllm_diffusion_plugin.doors.omni import lora_policy, lora_routes
from vllm_diffusion_plugin.doors.omni.lora_policy import RESULT_KEY, WORKER_METHOD

ROUTE = lora_routes.ROUTE
CURRENT = [{"component": "transformer", "path": "/old.safetensors", "scale": 1.0, "sha256": "ab", "fused_at": "t"}]


def ok(loras=CURRENT, **extra):
    return {RESULT_KEY: True, "ok": True, "kind": "ok", "error": None, "loras": loras, **extra}


class Engine:
    """vllm-omni's engine client as the routes use it: ``collective_rpc`` to the diffusion stage (nested per stage and
    replica, as vllm-omni returns it), ``stage_configs``."""

    def __init__(self, answer=None, *, gate: asyncio.Event | None = None, raises: Exception | None = None):
        self.calls: list[tuple] = []
        self.answer, self.gate, self.raises = answer or ok(), gate, raises
        self.stage_configs = [types.SimpleNamespace(stage_type="diffusion")]

    async def collective_rpc(self, *, method, args=(), stage_ids=None, timeout=None, kwargs=None):
        self.calls.append((method, args, stage_ids))
        if self.gate is not None:
            await self.gate.wait()
        if self.raises is not None:
            raise self.raises
        return [[self.answer]]


@pytest.fixture
def dirs(tmp_path):
    allowed, outside = tmp_path / "loras", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "a.safetensors").write_bytes(b"x")
    (allowed / "sub").mkdir()
    (outside / "secret.safetensors").write_bytes(b"s")
    return types.SimpleNamespace(allowed=allowed, outside=outside)


def make_app(dirs, engine, *, stopped=None):
    app = FastAPI()
    routes = lora_routes.LoraRoutes(lora_policy.allowed_dirs([str(dirs.allowed)]), [str(dirs.allowed)],
                                    stop=(lambda: stopped.append(1)) if stopped is not None else _no_stop)
    app.include_router(routes.router())
    app.state.engine_client, app.state.api_server_count = engine, 1
    return app


def _no_stop():
    raise AssertionError("the server was stopped")


async def _send(app, method, body=None, *, raw: bytes | None = None):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        content = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        return await client.request(method, ROUTE, content=content)


def send(app, method, body=None, *, raw=None):
    return asyncio.run(_send(app, method, body, raw=raw))


def message(response) -> str:
    payload = response.json()
    assert set(payload) == {"error"} and payload["error"]["code"] == response.status_code, payload
    assert "\n" not in payload["error"]["message"]
    return payload["error"]["message"]


# ---- off unless enabled ---------------------------------------------------------------------------------------
def test_routes_do_not_exist_unless_dirs_are_set(dirs, monkeypatch):
    monkeypatch.delenv("VLLM_DIFFUSION_LORA_UPDATE_DIRS", raising=False)
    for args in (types.SimpleNamespace(load_format="diffusion-hsdp", additional_config={"diffusion_hsdp": {}}),
                 types.SimpleNamespace(load_format="auto", additional_config={})):
        app = FastAPI()
        assert lora_routes.add_routes(app, args) is False
        app.state.engine_client = Engine()
        assert send(app, "GET").status_code == 404
        assert send(app, "POST", {"lora_path": []}).status_code == 404
    monkeypatch.setenv("VLLM_DIFFUSION_LORA_UPDATE_DIRS", str(dirs.allowed))  # not our load format: still off
    assert lora_routes.add_routes(FastAPI(), types.SimpleNamespace(load_format="auto")) is False


@pytest.mark.parametrize("how", ["additional-config", "env"])
def test_routes_exist_when_dirs_are_set(dirs, monkeypatch, how):
    monkeypatch.delenv("VLLM_DIFFUSION_LORA_UPDATE_DIRS", raising=False)
    config = {"diffusion_hsdp": {"lora_update_dirs": [str(dirs.allowed)]}}
    if how == "env":
        monkeypatch.setenv("VLLM_DIFFUSION_LORA_UPDATE_DIRS", os.pathsep.join([str(dirs.allowed), str(dirs.outside)]))
        config = {}
    app, engine = FastAPI(), Engine()
    assert lora_routes.add_routes(app, types.SimpleNamespace(load_format="diffusion-hsdp",
                                                                   additional_config=json.dumps(config)))
    app.state.engine_client, app.state.api_server_count = engine, 1
    response = send(app, "GET")
    assert response.status_code == 200 and response.json() == {"loras": CURRENT}
    assert engine.calls == [(WORKER_METHOD, (None,), [0])]


def test_unknown_option_key_is_still_refused():
    with pytest.raises(ValueError, match="lora_update_dir'"):
        lora_routes.update_dirs(types.SimpleNamespace(
            load_format="diffusion-hsdp", additional_config={"diffusion_hsdp": {"lora_update_dir": "/x"}}))


def test_allowed_dirs_must_be_absolute_existing_directories(dirs):
    with pytest.raises(ValueError, match="not an existing directory"):
        lora_policy.allowed_dirs([str(dirs.allowed / "missing")])
    with pytest.raises(ValueError, match="not an existing directory"):
        lora_policy.allowed_dirs([str(dirs.allowed / "a.safetensors")])
    with pytest.raises(ValueError, match="not an absolute path"):
        lora_policy.allowed_dirs(["loras"])


# ---- the body -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [b"{", b"[]", b'"x"', b'{"lora_path": "a"}', b'{"lora_path": [1]}',
                                 b'{"lora_path": [], "extra": 1}', b'{"lora_paths": []}', b"\xff\xfe"])
def test_malformed_bodies_are_400(dirs, raw):
    engine = Engine()
    response = send(make_app(dirs, engine), "POST", raw=raw)
    assert response.status_code == 400, response.text
    message(response)
    assert engine.calls == []


def test_bad_entries_inside_are_400_naming_them(dirs):
    engine = Engine()
    app = make_app(dirs, engine)
    for entry, why in ((f"{dirs.allowed}/none.safetensors", "no such file"), (f"{dirs.allowed}/sub", "regular file"),
                       ("a.safetensors", "absolute"), (f"{dirs.allowed}/a.safetensors@nan", "finite"),
                       (f"={dirs.allowed}/a.safetensors", "empty component")):
        response = send(app, "POST", {"lora_path": [entry]})
        assert response.status_code == 400 and why in message(response) and entry in message(response), response.text
    assert engine.calls == []


# ---- the path policy ------------------------------------------------------------------------------------------
def refused(app, entry) -> str:
    response = send(app, "POST", {"lora_path": [entry]})
    assert response.status_code == 403, (entry, response.text)
    return message(response).replace(entry, "<entry>")


def test_paths_outside_are_403_alike_whether_or_not_they_exist(dirs):
    engine = Engine()
    app = make_app(dirs, engine)
    exists = refused(app, str(dirs.outside / "secret.safetensors"))
    missing = refused(app, str(dirs.outside / "nothing.safetensors"))
    assert exists == missing and "lora_update_dirs" in exists and str(dirs.outside) not in exists
    assert refused(app, f"{dirs.allowed}/../outside/secret.safetensors") == exists
    assert refused(app, f"{dirs.allowed}/sub/../../outside/nothing.safetensors") == exists
    assert refused(app, f"transformer={dirs.outside}/secret.safetensors@0.5") == exists
    assert refused(app, f"{dirs.allowed}x/a.safetensors") == exists  # a sibling sharing the prefix
    assert engine.calls == []


def test_symlinks_that_leave_are_403(dirs):
    engine = Engine()
    app = make_app(dirs, engine)
    (dirs.allowed / "link.safetensors").symlink_to(dirs.outside / "secret.safetensors")
    (dirs.allowed / "dangling.safetensors").symlink_to(dirs.outside / "nothing.safetensors")
    (dirs.allowed / "out").symlink_to(dirs.outside, target_is_directory=True)
    first = refused(app, str(dirs.allowed / "link.safetensors"))
    assert refused(app, str(dirs.allowed / "dangling.safetensors")) == first
    assert refused(app, str(dirs.allowed / "out" / "secret.safetensors")) == first
    assert engine.calls == []


def test_hard_links_are_403(dirs):
    engine = Engine()
    os.link(dirs.outside / "secret.safetensors", dirs.allowed / "hard.safetensors")
    assert "hard link" in refused(make_app(dirs, engine), str(dirs.allowed / "hard.safetensors"))
    assert engine.calls == []


def test_accepted_entries_reach_the_workers_as_real_paths(dirs):
    engine = Engine(ok(report={"seconds": 0.5}, seconds=0.7))
    (dirs.allowed / "sub" / "b@2.safetensors").write_bytes(b"y")
    (dirs.allowed / "sub" / "alias.safetensors").symlink_to(dirs.allowed / "a.safetensors")
    body = {"lora_path": [f"transformer={dirs.allowed}/sub/alias.safetensors@0.5",
                          f"{dirs.allowed}/sub/../sub/b@2.safetensors"]}
    response = send(make_app(dirs, engine), "POST", body)
    assert response.status_code == 200, response.text
    assert response.json() == {"loras": CURRENT, "seconds": 0.7, "report": {"seconds": 0.5}}
    real = os.path.realpath(dirs.allowed)
    assert engine.calls == [(WORKER_METHOD, ([["transformer", f"{real}/a.safetensors", 0.5],
                                              [None, f"{real}/sub/b@2.safetensors", None]],), [0])]
    assert send(make_app(dirs, engine), "POST", {"lora_path": []}).status_code == 200  # no LoRA
    assert engine.calls[-1][1] == ([],)


# ---- one at a time --------------------------------------------------------------------------------------------
def test_a_second_update_while_one_runs_is_409(dirs):
    async def both():
        gate = asyncio.Event()
        engine = Engine(gate=gate)
        app = make_app(dirs, engine)
        first = asyncio.create_task(_send(app, "POST", {"lora_path": [str(dirs.allowed / "a.safetensors")]}))
        while not engine.calls:
            await asyncio.sleep(0.01)
        try:  # answered at once, not after the first (which waits on the gate): a bounded wait, never a hang
            second = await asyncio.wait_for(_send(app, "POST", {"lora_path": []}), timeout=10)
        finally:
            gate.set()
        return await first, second, engine

    first, second, engine = asyncio.run(both())
    assert first.status_code == 200 and second.status_code == 409 and "another LoRA update" in message(second)
    assert len(engine.calls) == 1


def test_several_api_servers_are_409(dirs):
    engine = Engine()
    app = make_app(dirs, engine)
    app.state.api_server_count = 2
    assert send(app, "POST", {"lora_path": []}).status_code == 409 and engine.calls == []


# ---- what the workers answered --------------------------------------------------------------------------------
def failed(**fields):
    return {RESULT_KEY: True, "ok": False, **fields}


@pytest.mark.parametrize("answer,status,says", [
    (failed(kind="refused", error="LoRA file /l/x.safetensors: 3 keys match no module"), 400, "/l/x.safetensors"),
    (failed(kind="unsupported", error="needs hsdp_weight_load=rank_local"), 409, "rank_local"),
])
def test_worker_answers_map_to_statuses_and_the_server_keeps_serving(dirs, answer, status, says):
    response = send(make_app(dirs, Engine(answer)), "POST", {"lora_path": []})
    assert response.status_code == status and says in message(response)


def test_a_failure_after_weights_changed_stops_the_server(dirs):
    stopped = []
    response = send(make_app(dirs, Engine(failed(kind="failed", error="rank 1 read failed")),
                             stopped=stopped), "POST", {"lora_path": []})
    assert response.status_code == 500 and "rank 1 read failed" in message(response) and "stops" in message(response)
    assert stopped == [1]


def test_an_rpc_that_did_not_answer_stops_the_server(dirs):
    stopped = []
    for engine in (Engine(raises=RuntimeError("engine dead")), Engine({"supported": False, "error": "x"})):
        response = send(make_app(dirs, engine, stopped=stopped), "POST", {"lora_path": []})
        assert response.status_code == 500, response.text
    assert stopped == [1, 1]


def test_get_reports_the_current_set_and_never_stops(dirs):
    assert send(make_app(dirs, Engine()), "GET").json() == {"loras": CURRENT}
    response = send(make_app(dirs, Engine(raises=RuntimeError("dead"))), "GET")
    assert response.status_code == 500 and "dead" in message(response)
