"""``python -m vllm_diffusion_plugin.doors.cli``: the ``vllm-diffusion`` command."""

from vllm_diffusion_plugin.doors.cli import run

run()
