"""The doors into the engine: the CLI, the vLLM model loader and the vllm-omni patches.

Doors import the engine; nothing in ``vllm_diffusion_plugin.engine`` imports a door.
"""
