"""The shared LoRA types: the normal form (``LoraDelta``), a read file (``LoraFile``), what a fusion did
(``FuseStats``) and every format error.

Every layout module (``peft``, ``kohya``, ``wan``, ``diffusers_layouts``) and the dispatch (``normal``) import
from here and from nowhere else in this package, so the package has no import circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "FuseStats", "LoraConversionError", "LoraDelta", "LoraFile", "LoraFormatError", "LoraRankError", "LoraShapeError",
    "NoLoraTargetsError", "NonFiniteLoraError", "PartialPackedLoraError", "UnmatchedLoraKeysError",
    "UnsupportedLoraError",
]


class LoraFormatError(ValueError):
    """A LoRA file that cannot be mapped onto the module; raised before any weight is touched."""


class UnmatchedLoraKeysError(LoraFormatError):
    """Keys that match no module of the target (strict mode)."""


class LoraShapeError(LoraFormatError):
    """A LoRA tensor whose shape does not fit the target weight or bias."""


class LoraRankError(LoraFormatError):
    """``lora_A`` and ``lora_B`` (or the adapter config) disagree on the rank."""


class NonFiniteLoraError(LoraFormatError):
    """A LoRA tensor or alpha holding NaN or inf."""


class PartialPackedLoraError(LoraFormatError):
    """Some, not all, slices of a packed (fused q/k/v or gate/up) target carry a delta."""


class UnsupportedLoraError(LoraFormatError):
    """A LoRA variant that cannot be fused as ``W + s * B @ A`` (DoRA, LoHa, LoKr, ...)."""


class LoraConversionError(LoraFormatError):
    """A layout only diffusers' converters read, and they could not (diffusers missing, refused, or dropped keys)."""


class NoLoraTargetsError(LoraFormatError):
    """A LoRA file none of whose keys fuses into the module (strict mode)."""


@dataclass(frozen=True, eq=False)
class LoraDelta:
    """The update of one target: ``W += scale * B @ A``; ``bias += bias_delta``; ``W += full_delta``.

    ``A`` is ``(rank, in_features)``, ``B`` is ``(out_features, rank)``, both None for a target with only
    full/bias deltas. ``scale`` multiplies ``B @ A`` only; ``bias_delta`` and ``full_delta`` are final
    (already multiplied by their scale); ``full_delta`` is a tensor or, for LoKr / LoHa, a
    ``lycoris.FactoredDelta`` (materialized only while it is fused). ``source_keys`` are the file keys it came
    from and ``origin`` the file and component (``LoRA file PATH for COMPONENT``, set by ``prepare_lora_files``),
    for messages.
    """

    A: torch.Tensor | None
    B: torch.Tensor | None
    scale: float
    bias_delta: torch.Tensor | None = None
    full_delta: torch.Tensor | None = None
    source_keys: tuple[str, ...] = ()
    origin: str = ""

    @property
    def rank(self) -> int:
        return 0 if self.A is None else int(self.A.shape[0])


@dataclass(frozen=True)
class LoraFile:
    """A loaded LoRA: its tensors and, when the file carries one, its PEFT adapter config."""

    path: Path
    state_dict: dict[str, torch.Tensor]
    adapter_config: dict | None


@dataclass(frozen=True)
class FuseStats:
    """What one fuse/unfuse did.

    ``compute_device``: the accelerator used for at least one weight, else ``"cpu"``. ``cpu_kernel``: the
    CPU rule's choices when any weight was fused on the CPU (``"native"``, ``"fp32-chunks"``, joined by ``+``
    when both were used), else None.
    ``targets``: LoRA targets (file keys grouped per module) applied; ``params``: tensors modified;
    ``fallbacks``: weights moved to the CPU path after an accelerator failure; ``host_rule``: where host-resident
    weights were fused and why, when an accelerator was usable (``HostSide.why``), else None.
    """

    compute_device: str
    cpu_kernel: str | None
    targets: int
    params: int
    fallbacks: int
    seconds: float
    host_rule: str | None = None

    def __add__(self, other: FuseStats) -> FuseStats:
        accel = self.compute_device if self.compute_device != "cpu" else other.compute_device
        return FuseStats(accel, self.cpu_kernel or other.cpu_kernel, self.targets + other.targets,
                         self.params + other.params, self.fallbacks + other.fallbacks, self.seconds + other.seconds,
                         self.host_rule or other.host_rule)
