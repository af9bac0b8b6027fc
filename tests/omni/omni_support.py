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
from vllm_diffusion_plugin.tiny.models import TINY_CONFIGS

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


FAMILIES = {  # vllm-omni module, class (diffusers has the same name), a tiny config both accept
    "flux": ("vllm_omni.diffusion.models.flux.flux_transformer", "FluxTransformer2DModel",
             TINY_CONFIGS["flux"] | {"guidance_embeds": False}),
    "qwen_image": ("vllm_omni.diffusion.models.qwen_image.qwen_image_transformer", "QwenImageTransformer2DModel",
                   TINY_CONFIGS["qwen-image"]),
    "z_image": ("vllm_omni.diffusion.models.z_image.z_image_transformer", "ZImageTransformer2DModel",
                TINY_CONFIGS["z-image"]),
}


def load_pipeline(folder, pipeline_class: str, vllm_config, options: dict, **stage):
    """``(model, loader)``: vllm-omni's ``DiffusersPipelineLoader`` loading ``folder`` as a diffusion worker does
    with ``--load-format diffusion-hsdp --additional-config '{"diffusion_hsdp": options}'`` (``stage``: more
    stage arguments, e.g. ``use_hsdp``), the stage config enriched as the engine does before the workers start,
    in a forward context of ``vllm_config`` (whose parallel state the caller set up)."""
    import torch
    from vllm.config.load import LoadConfig
    from vllm_omni.config.omni_config import extract_diffusion_stage_config_kwargs
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    od_config = OmniDiffusionConfig(**extract_diffusion_stage_config_kwargs(dict(
        model=str(folder), model_class_name=pipeline_class, dtype="float32", load_format="diffusion-hsdp",
        additional_config={"diffusion_hsdp": options}, **stage), stage_id=0))
    od_config.enrich_config()  # the transformer's config.json
    loader = DiffusersPipelineLoader(LoadConfig(), od_config=od_config)  # as the diffusion model runner builds it
    with set_forward_context(vllm_config=vllm_config, omni_diffusion_config=od_config):
        model = loader.load_model(load_device="cpu", load_format="default", device=torch.device("cpu"))
    return model, loader


class OneDitPipeline(nn.Module):
    """A pipeline holding one vllm-omni DiT under ``transformer.`` (what its pipelines' ``load_weights`` route)."""

    def __init__(self, dit: nn.Module) -> None:
        super().__init__()
        self.transformer = dit

    def load_weights(self, weights):
        loaded = self.transformer.load_weights((n.removeprefix("transformer."), t) for n, t in weights)
        return {f"transformer.{n}" for n in loaded}


def hsdp_world(world_size: int, rank: int) -> None:
    """vllm-omni's diffusion world over gloo for this rank: ``world_size`` ranks in one HSDP shard group (the ranks of
    ``dist_utils.run_distributed``); once per process, inside ``set_current_vllm_config``."""
    from vllm_omni.diffusion.distributed import parallel_state

    if parallel_state._WORLD is None:
        parallel_state.init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank,
                                                    distributed_init_method="env://", backend="gloo")
        parallel_state.initialize_model_parallel(fully_shard_degree=world_size, use_hsdp=True, backend="gloo")


def build_family_dit(family: str) -> nn.Module:
    """vllm-omni's DiT of ``family`` at its tiny config, float32 (on the CPU, vLLM 0.30's ``SiluAndMul`` needs an
    op the PyPI wheel lacks: ``cpu_ops`` registers it)."""
    import inspect
    import sys
    from pathlib import Path

    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_scenarios"))
    from cpu_ops import ensure_cpu_ops

    ensure_cpu_ops()
    module, name, config = FAMILIES[family]
    cls = getattr(importlib.import_module(module), name)
    kwargs = dict(config)
    od_config = inspect.signature(cls).parameters.get("od_config")
    if od_config is not None and od_config.default is inspect.Parameter.empty:
        kwargs["od_config"] = OmniDiffusionConfig(model="/unused")  # required (Qwen-Image reads its parallel config)
    with set_default_torch_dtype(torch.float32):
        return cls(**kwargs)


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


def tensor_bytes(folder) -> int:
    """Bytes of every tensor in the ``*.safetensors`` files of ``folder`` (what reading each tensor once reads)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys())
    return total
