"""vLLM general plugin ``diffusion_cpu_fp8``: ``--quantization torch_fp8`` / ``torch_fp8_per_channel`` and pre-quantized
ModelOpt FP8 checkpoints (``testing/cpu_modelopt.py``) for servers on our CPU platform.

vLLM's ``fp8`` has no CPU kernel, so an FP8 server cannot be proven on a CPU-only host with it. With
``VLLM_DIFFUSION_OMNI_CPU=1`` (our CPU platform for vllm-omni) this registers the pure-torch online fp8 of
:mod:`.online_quant` through vllm-omni's own quantization override hook, in every process vLLM loads its general
plugins in (the API server and each diffusion worker), and says so once per process: a CPU stand-in, not vLLM's fp8.
Anywhere else it does nothing and imports nothing of vllm-omni (importing it in a plain vLLM process would apply
vllm-omni's own patches to vLLM). A plugin of its own, not a call from the CPU platform: a door never imports
``testing/`` (``tests/test_layout.py``).
"""

from __future__ import annotations

import importlib.util

from vllm_diffusion_plugin import envs
from vllm_diffusion_plugin._logging import init_logger

logger = init_logger(__name__)


def register() -> None:
    try:
        if not envs.get("VLLM_DIFFUSION_OMNI_CPU") or importlib.util.find_spec("vllm_omni") is None:
            return
    except ValueError:  # an invalid value: the CPU platform's entry point names it
        return
    from vllm_diffusion_plugin.testing.cpu_modelopt import register as register_modelopt
    from vllm_diffusion_plugin.testing.online_quant import register_omni_override

    names = register_omni_override()
    logger.info("CPU platform: --quantization %s registered through vllm-omni's quantization override hook: a "
                "pure-torch fp8 for CPU proofs (testing/online_quant.py), not vLLM's fp8", " / ".join(names))
    logger.info("CPU platform: pre-quantized ModelOpt FP8 checkpoints (quantization %r) served by a pure-torch "
                "stand-in registered through vLLM's register_quantization_config (testing/cpu_modelopt.py): "
                "vLLM's parameters and post-processing arithmetic, weights dequantized in the forward; not vLLM's "
                "ModelOpt kernels", register_modelopt())
