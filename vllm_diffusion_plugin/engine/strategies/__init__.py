"""The ``hsdp_weight_load`` strategies: how the ranks of an HSDP job get their weights. One module each,
siblings behind one call (``base.Strategy``: ``load(source, *, context, lora_files) -> ComponentLoad``):

- ``full`` -- every rank reads the whole checkpoint into a full host copy, fuses LoRA, then the pipeline
  shards (simple, but S ranks read S copies and each holds a full model before sharding);
- ``broadcast`` -- rank 0 reads (and fuses LoRA) once; the others receive the tensors in bounded buckets
  and read 0 bytes;
- ``rank_local`` -- for the sharded DiTs: built on ``meta``, sharded there, each rank reads its own rows into
  its local shards and fuses LoRA shard-locally; other components load with ``full``.

``base.check_strategy`` rejects combinations a strategy cannot serve at configuration time, before any weight
is read, naming a strategy that works; with one process every strategy is ``full``.
"""

from vllm_diffusion_plugin.engine.errors import DistributedLoadError, StrategyError
from vllm_diffusion_plugin.engine.strategies.base import (
    STRATEGIES,
    ComponentLoad,
    LoadContext,
    Strategy,
    check_strategy,
)
from vllm_diffusion_plugin.engine.strategies.broadcast import load_broadcast
from vllm_diffusion_plugin.engine.strategies.full import load_full
from vllm_diffusion_plugin.engine.strategies.rank_local import load_rank_local

LOADERS: dict[str, Strategy] = {"full": load_full, "broadcast": load_broadcast, "rank_local": load_rank_local}
"""Each strategy's load function by ``hsdp_weight_load`` name."""

__all__ = ["LOADERS", "STRATEGIES", "ComponentLoad", "DistributedLoadError", "LoadContext", "Strategy",
           "StrategyError", "check_strategy", "load_broadcast", "load_full", "load_rank_local"]
