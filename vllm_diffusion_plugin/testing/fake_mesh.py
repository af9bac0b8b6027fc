"""A ``fakeacc`` device mesh in one process: torch's fake process group serving the fake accelerator, for tests that
shard with FSDP2 on a device without starting ranks (``fake_mesh``)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed import fake_pg
from torch.testing._internal.distributed.fake_pg import FakeStore

from vllm_diffusion_plugin.testing.fake_accelerator import DEVICE_TYPE, install


def register_fake_process_group() -> None:
    """Let torch's fake process group (backend ``"fake"``) serve ``fakeacc`` tensors too.

    The fake group runs a single rank of any world size without communicating (collectives
    return garbage); enough to build a DeviceMesh and call ``fully_shard``. Idempotent.
    """
    devices = dist.Backend.backend_capability[dist.Backend.FAKE]
    if DEVICE_TYPE not in devices:
        dist.Backend.register_backend(
            dist.Backend.FAKE, fake_pg._create_fake_pg, extended_api=True, devices=[*devices, DEVICE_TYPE]
        )


@contextlib.contextmanager
def fake_mesh(
    shape: tuple[int, ...] = (1, 2), *, mesh_dim_names: tuple[str, ...] | None = ("replicate", "shard")
) -> Iterator[DeviceMesh]:
    """Yield a ``fakeacc`` DeviceMesh of ``shape`` in this one process, as rank 0 of a fake world.

    Initializes the default process group with the fake backend (world size ``prod(shape)``) and
    destroys it on exit. Raises if a default process group already exists.
    """
    install()
    register_fake_process_group()
    if dist.is_initialized():
        raise RuntimeError("fake_mesh needs a process without a default process group")
    dist.init_process_group("fake", rank=0, world_size=math.prod(shape), store=FakeStore())
    try:
        yield init_device_mesh(DEVICE_TYPE, shape, mesh_dim_names=mesh_dim_names)
    finally:
        dist.destroy_process_group()
