"""The ``diffusion-hsdp`` vLLM model loader: vLLM's front door to the plugin's load path.

Registered by ``register()`` when the plugin is enabled; selected with
``vllm serve MODEL --load-format diffusion-hsdp --model-loader-extra-config '{...}'``.
Options are parsed (and rejected) in ``__init__``, before any weight is read.
"""

from __future__ import annotations

import torch.nn as nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm_diffusion_plugin._logging import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from vllm_diffusion_plugin.config import LoadOptions

logger = init_logger(__name__)


class DiffusionHSDPLoader(BaseModelLoader):
    """Streams a diffusers/HF checkpoint through the plugin's pipeline inside vLLM."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = LoadOptions.from_extra_config(load_config.model_loader_extra_config)

    def download_model(self, model_config: ModelConfig) -> None:
        from vllm_diffusion_plugin.checkpoint import resolve_checkpoint

        resolve_checkpoint(model_config.model, revision=model_config.revision,
                           allow_pickle=self.options.allow_pickle)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        from vllm_diffusion_plugin.checkpoint import resolve_component_for_vllm
        from vllm_diffusion_plugin.weights import iterate_weights, load_into_module

        source = resolve_component_for_vllm(model_config, allow_pickle=self.options.allow_pickle)
        load_into_module(model, iterate_weights(source), source=source,
                         strict_unexpected=self.options.strict_unexpected)
