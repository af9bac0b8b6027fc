"""Test-only: vllm-omni's own ``ZImagePipeline`` with its DiT built at the size of the folder's
``transformer/config.json``, for the Z-Image serving proof (``test_serve_images.py``).

Why. vllm-omni 0.30's ``ZImagePipeline.__init__`` builds ``ZImageTransformer2DModel(quant_config=...)`` with the
constructor's defaults (``vllm_omni/diffusion/models/z_image/pipeline_z_image.py:228``: Z-Image-Turbo's dim 3840,
30 layers, cap_feat_dim 2560, ...), whatever the folder's ``transformer/config.json`` says; a tiny folder's
weights then do not fit (and building the 6B DiT in float32 on a small CPU host does not either).

How. ``ConfigSizedZImagePipeline`` runs vllm-omni's own ``ZImagePipeline.__init__`` with the module's
``ZImageTransformer2DModel`` name bound, for that call only, to the same class with the config's constructor
arguments; everything else (text encoder, VAE, scheduler, weight sources, ``load_weights``, ``forward``) is
vllm-omni's unchanged. Served with
``--custom-pipeline-args '{"pipeline_class": "z_image_pipeline.ConfigSizedZImagePipeline"}'`` (this folder
on the workers' ``PYTHONPATH``); vllm-omni then loads it with its ``custom_pipeline`` load format, the path our
door carries (``patch_load_path.CARRIED_PIPELINE_FORMATS``).

Is it a fair proof of our door? Yes: the reference, the control and ours all run this same class; the only
difference between the reference and ours is who reads the DiT and fuses the LoRA (vllm-omni's loader reading a
diffusers-merged folder vs our load path reading the original folder plus the LoRA file).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from vllm_omni.diffusion.models.z_image import pipeline_z_image as _omni

NOT_FROM_CONFIG = ("self", "quant_config")


def transformer_kwargs(model: str | Path) -> dict:
    """The ``ZImageTransformer2DModel`` constructor arguments found in ``MODEL/transformer/config.json``."""
    config = json.loads((Path(model) / "transformer" / "config.json").read_text())
    params = inspect.signature(_omni.ZImageTransformer2DModel.__init__).parameters
    kwargs = {k: v for k, v in config.items() if k in params and k not in NOT_FROM_CONFIG}
    for key in ("all_patch_size", "all_f_patch_size"):
        if key in kwargs:
            kwargs[key] = tuple(kwargs[key])
    return kwargs


class ConfigSizedZImagePipeline(_omni.ZImagePipeline):
    """vllm-omni's ``ZImagePipeline`` whose DiT has the folder's configured size (see the module docstring)."""

    def __init__(self, *, od_config, prefix: str = ""):
        original = _omni.ZImageTransformer2DModel
        kwargs = transformer_kwargs(od_config.model)

        def sized(**given):
            return original(**(kwargs | given))

        _omni.ZImageTransformer2DModel = sized
        try:
            super().__init__(od_config=od_config, prefix=prefix)
        finally:
            _omni.ZImageTransformer2DModel = original
