"""The engine's errors: each says in one line what is wrong and names the file, key, rank or option at fault.

The LoRA file errors are the ``lora`` package's (``lora.types``); everything else a load raises is here.
"""

from __future__ import annotations

from pathlib import Path


class ReadTimeoutError(TimeoutError):
    """A read handed to the read threads did not complete within ``read_timeout_s``; the message names the file
    and the offset. The thread stays blocked in the kernel (no signal ends a read a FUSE server took); it is a
    daemon thread, so the process's exit does not wait for it -- though Linux may, until the store answers."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as is; the message names the file, key or folder at fault."""


class PickleRefusedError(CheckpointError):
    """Only pickle weights and pickle was not allowed; ``with_how`` names the door's own switch."""

    def __init__(self, folder: Path, first: str, how: str = "pass allow_pickle=True "
                                                            "(VLLM_DIFFUSION_ALLOW_PICKLE=1)") -> None:
        super().__init__(f"{folder}: only pickle weights ({first} ...) and no safetensors; to load them with "
                         f"torch.load(weights_only=True), {how}")
        self.folder, self.first = folder, first

    def with_how(self, how: str) -> PickleRefusedError:
        return PickleRefusedError(self.folder, self.first, how)


class CheckpointChangedError(CheckpointError):
    """A checkpoint file changed between its header read and the end of the load of its component."""


class WeightLoadError(ValueError):
    """Checkpoint and module disagree (missing, unexpected or mismatched keys); the message names them."""


class StrategyError(ValueError):
    """A weight-load strategy that cannot serve this load; the message names one that can."""


class DistributedLoadError(RuntimeError):
    """A distributed load failed across ranks: a rank died, stalled, failed or disagreed; or a rank-local
    read left tensors uncovered. The message names the rank, the component and the bucket or tensors."""


class RowQuantError(ValueError):
    """An online quant method ``rank_local`` cannot apply row by row; the message names the layer and method."""


class PreQuantError(ValueError):
    """A pre-quantized checkpoint this load does not carry; one line naming the format and the component."""


class PreflightError(RuntimeError):
    """The planned load does not fit what a rank has; the message is the one line the door prints."""
