"""vllm-diffusion-plugin: a vLLM general plugin that loads diffusion transformers fast and correctly.

vLLM calls ``register()`` (entry point group ``vllm.general_plugins``) in every process. It does nothing
unless ``VLLM_DIFFUSION_PLUGIN`` enables the plugin; importing this package is cheap (no torch, no vLLM,
no diffusers) so a disabled plugin costs nothing.

Layout: ``engine/`` turns a checkpoint into loaded modules (see ``engine/__init__.py`` and
``docs/architecture.md``); ``doors/`` are the ways in (CLI, vLLM loader, vllm-omni patches). The main public
API is re-exported here lazily (``from vllm_diffusion_plugin import load_components`` imports the engine on
first use).
"""

from __future__ import annotations

__version__ = "0.1.0"

from vllm_diffusion_plugin.engine.config import LOAD_FORMAT  # noqa: E402  (the public name; light: no torch)

_registered = False

_PUBLIC = {  # name -> module that owns it; imported on first attribute access
    "LoadOptions": "vllm_diffusion_plugin.engine.session",
    "LoadSession": "vllm_diffusion_plugin.engine.session",
    "HSDPConfig": "vllm_diffusion_plugin.engine.session",
    "LoraSpec": "vllm_diffusion_plugin.engine.session",
    "load_components": "vllm_diffusion_plugin.engine.session",
    "save_components": "vllm_diffusion_plugin.engine.session",
    "fuse_lora_files": "vllm_diffusion_plugin.engine.lora",
    "process_weights_after_loading": "vllm_diffusion_plugin.engine.session",
}


def __getattr__(name: str) -> object:
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


def register() -> None:
    """The vLLM general-plugin entry point: env-gated, idempotent, cheap.

    Disabled (``VLLM_DIFFUSION_PLUGIN`` unset/0/false/no/off): returns at once. Enabled: registers the
    ``diffusion-hsdp`` load format with vLLM's loader registry, registers our env var names with vLLM's env
    registry, arms the vllm-omni patches (when vllm-omni is installed) and logs one INFO line. An invalid value raises ``ValueError`` (vLLM then refuses to start).
    """
    global _registered
    from vllm_diffusion_plugin import envs

    if not envs.get("VLLM_DIFFUSION_PLUGIN") or _registered:
        return

    from vllm_diffusion_plugin import compat
    from vllm_diffusion_plugin._logging import init_logger

    envs.validate_all()  # fail fast on any other malformed VLLM_DIFFUSION_* value
    compat.register_env_vars(list(envs.ENV_VARS))
    from vllm_diffusion_plugin.doors.vllm_loader import DiffusionHSDPLoader

    compat.register_model_loader(LOAD_FORMAT)(DiffusionHSDPLoader)
    from vllm_diffusion_plugin.doors.omni import apply_patches

    apply_patches()  # vllm-omni: patched when its loader modules are imported; a no-op without it

    _registered = True
    init_logger(__name__).info(
        "vllm-diffusion-plugin %s enabled: load format `%s` registered (vLLM %s).",
        __version__, LOAD_FORMAT, compat.vllm_version(),
    )

