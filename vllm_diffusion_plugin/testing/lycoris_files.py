"""LyCORIS LoKr / LoHa files for tests, made by peft: peft's own adapter layers build the factors (and its
``merge_and_unload`` is the oracle); the file is peft's adapter state dict under LyCORIS / kohya key names.

    peft_model = peft_lycoris(model, "lokr", r=4, alpha=6, target_modules=[...], seed=1)
    write_lycoris_file(path, peft_model)          # lora_unet_<module>.lokr_w1 ..., <module>.alpha
    merged = peft_model.merge_and_unload()        # what fusing the file must give
"""

from __future__ import annotations

from pathlib import Path

import torch

ADAPTER_PREFIXES = ("lokr_", "hada_")


def peft_lycoris(model: torch.nn.Module, kind: str, *, seed: int, std: float = 0.1, **config) -> torch.nn.Module:
    """``model`` wrapped by peft's LoKr (``kind="lokr"``) or LoHa (``"loha"``) layers (``config``: the peft
    config's fields), every adapter factor seeded random (peft initializes one factor to zero)."""
    from peft import LoHaConfig, LoKrConfig, get_peft_model

    cls = {"lokr": LoKrConfig, "loha": LoHaConfig}[kind]
    peft_model = get_peft_model(model, cls(**config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if any(part.startswith(ADAPTER_PREFIXES) for part in name.split(".")):
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    return peft_model


def lycoris_state_dict(peft_model: torch.nn.Module, *, naming: str = "kohya") -> dict[str, torch.Tensor]:
    """peft's adapter state dict under LyCORIS names: ``naming="kohya"``: ``lora_unet_<module_underscored>.<kind>``
    (what LyCORIS and kohya trainers write); ``"dotted"``: ``<module>.<kind>``; each module with its ``.alpha``."""
    from peft import get_peft_model_state_dict

    config = peft_model.peft_config["default"]
    out: dict[str, torch.Tensor] = {}
    for key, tensor in get_peft_model_state_dict(peft_model).items():
        module, _, kind = key.removeprefix("base_model.model.").rpartition(".")
        stem = f"lora_unet_{module.replace('.', '_')}" if naming == "kohya" else module
        out[f"{stem}.{kind}"] = tensor.detach().clone().contiguous()
        out[f"{stem}.alpha"] = torch.tensor(float(config.alpha))
    return out


def write_lycoris_file(path: Path, peft_model: torch.nn.Module, *, naming: str = "kohya") -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(lycoris_state_dict(peft_model, naming=naming), str(path))
    return path
