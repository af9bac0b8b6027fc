"""pytest plugin used by :mod:`.regression` inside each of its pytest runs (``-p`` this module).

At ``pytest_configure`` it loads the general plugins as a vllm-omni diffusion worker does before it loads a
model (``vllm_omni.plugins.load_omni_general_plugins``, which runs vLLM's ``load_general_plugins`` and so this
plugin's ``register()``; vLLM's own when vllm-omni has no such function). Whether ``register()`` then arms
the vllm-omni patches is up to ``VLLM_DIFFUSION_PLUGIN``, exactly as in a server. At the end of the session it
writes what it saw to the JSON file named by ``VLLM_DIFFUSION_REGRESSION_PROBE``: the variable's value, each
patch unit's state (``patch_status()``) and which vllm-omni was imported. Without the variable it does
nothing, so a stray ``-p`` in another run changes nothing.
"""

from __future__ import annotations

import json
import os
import sys

from vllm_diffusion_plugin.doors.omni import patch_status

PROBE_ENV = "VLLM_DIFFUSION_REGRESSION_PROBE"
_load_error: str | None = None


def pytest_configure(config) -> None:
    global _load_error
    if not os.environ.get(PROBE_ENV):
        return
    try:
        try:
            from vllm_omni.plugins import load_omni_general_plugins as load
        except ImportError:
            from vllm.plugins import load_general_plugins as load
        load()
    except Exception as exc:  # recorded, so the caller can say why the plugin was not active
        _load_error = f"{type(exc).__name__}: {exc}"


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get(PROBE_ENV)
    if not path:
        return

    omni = sys.modules.get("vllm_omni")
    record = {
        "VLLM_DIFFUSION_PLUGIN": os.environ.get("VLLM_DIFFUSION_PLUGIN"),
        "patch_status": patch_status(),
        "vllm_omni_version": getattr(omni, "__version__", None),
        "vllm_omni_file": getattr(omni, "__file__", None),
        "plugin_load_error": _load_error,
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
