"""``python -m vllm_diffusion_plugin.doors.cli``: the ``vllm-diffusion`` command."""

import sys

from vllm_diffusion_plugin.doors.cli import main

sys.exit(main())
