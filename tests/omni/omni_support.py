"""Helpers for the vllm-omni patch tests (see conftest.py for the environment)."""

from __future__ import annotations

import importlib
import os
import types

import pytest
import torch
from torch import nn
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from vllm_diffusion_plugin.testing.logs import captured_logs  # noqa: F401  (re-exported for the omni tests)

REQUIRED = os.environ.get("OMNI_TESTS_REQUIRED") == "1"


def import_omni() -> types.ModuleType:
    """``import vllm_omni``: an error under ``OMNI_TESTS_REQUIRED=1``, else a skip when it is absent."""
    if REQUIRED:
        return importlib.import_module("vllm_omni")
    return pytest.importorskip("vllm_omni")


def omni_config(**kwargs):
    """A vllm-omni ``OmniDiffusionConfig`` (fp32 unless given)."""
    import torch
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    kwargs.setdefault("dtype", torch.float32)
    return OmniDiffusionConfig(**kwargs)


def omni_loader(load_format: str = "diffusion-hsdp", extra: dict | None = None, **od_kwargs):
    """vllm-omni's ``DiffusersPipelineLoader`` with a vLLM ``LoadConfig`` as ``--load-format`` would make it."""
    from vllm.config.load import LoadConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    return DiffusersPipelineLoader(LoadConfig(load_format=load_format, model_loader_extra_config=extra or {}),
                                   omni_config(**od_kwargs))


class RecordingMethod(QuantizeMethodBase):
    """An offline quant method whose post-processing doubles the weight and records where it ran."""

    def __init__(self) -> None:
        self.calls: list[dict[str, tuple[str, str]]] = []

    def create_weights(self, layer, *args, **kwargs):
        raise NotImplementedError("weights come from nn.Linear here")

    def apply(self, layer, x, bias=None):
        return nn.functional.linear(x, layer.weight, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls.append({n: (str(p.device), type(p).__name__) for n, p in layer.named_parameters()})
        with torch.no_grad():
            layer.weight.mul_(2.0)


class RecordedLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.quant_method = RecordingMethod()
