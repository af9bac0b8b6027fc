"""On paper, the real size: ``plan`` over a Wan2.2 A14B folder of the real shapes, at S = 1, 4, 8.

Writes once (cached in ``--out-dir``) a diffusers-layout Wan2.2 A14B pipeline folder whose safetensors headers
list every tensor of each component at its real shape and dtype, and whose data regions are holes (the header,
then ``truncate`` to the full length): a few MB of disk for ~57 GB of "weights". ``plan`` reads headers only, so
its answer for this folder is its answer for the real checkpoint.

- ``transformer`` and ``transformer_2``: ``WanTransformer3DModel`` at A14B size (40 blocks, 40 x 128 heads,
  13824 FFN, text_dim 4096), bf16 (float32 for the class's ``_keep_in_fp32_modules``, as diffusers saves it),
  ~5 GB shards with ``diffusion_pytorch_model.safetensors.index.json``;
- ``vae``: ``AutoencoderKLWan`` at its default config (the Wan2.1 VAE that A14B uses);
- ``text_encoder`` (UMT5-XXL encoder, a ``transformers`` class) only when the project's ``build_component`` can
  build it on ``meta``; otherwise it is left out and the output says why (and its size, counted on ``meta`` by
  transformers);
- one rank-64 "distill" LoRA per transformer (PEFT / diffusers keys ``transformer.blocks.N.attn1.to_q.lora_A
  .weight``, every Linear of every block: attn1 / attn2 q, k, v, o, ffn.net.0.proj, ffn.net.2), bf16, written as
  real zero-filled files (``plan`` reads LoRA files whole to check them against the skeletons).

The tensor lists come from the modules built on ``meta`` by ``vllm_diffusion_plugin.engine.skeleton
.build_component`` (the builder the load and the plan use). Then ``engine.plan.plan_load`` runs (in process, as
``vllm-diffusion plan DIR --lora HIGH --lora LOW --nproc S --hsdp-shard-size S --hsdp-replicate-size 1
--device cpu --dtype bfloat16 --components transformer,transformer_2,vae`` would) for each S, and a markdown
table is printed: per S, per rank (max over ranks) bytes read, bytes held after the load and planned host peak,
for ours (``rank_local``) and for vllm-omni's own load (every DiT whole on every rank, as our ``full`` models
it; ``broadcast`` as its broadcast). With one rank every strategy runs as ``full``.

    python benchmarks/plan_real_size.py [--out-dir /tmp/vllm-diffusion-real-size] [--sizes 1,4,8] [--json]
        [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
import time
from pathlib import Path
from types import MappingProxyType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import charts  # noqa: E402

WAN_A14B = dict(patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                rope_max_seq_len=1024, pos_embed_seq_len=None)
"""Wan2.2-T2V-A14B's ``transformer`` / ``transformer_2`` config (both experts share it)."""
WAN_VAE: dict = {}
"""``AutoencoderKLWan`` at its defaults: base_dim 96, z_dim 16, dim_mult [1, 2, 4, 4] (the Wan2.1 VAE)."""
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                relative_attention_max_distance=128, tie_word_embeddings=False, dtype="bfloat16")
"""The UMT5-XXL encoder Wan uses as ``text_encoder`` (``transformers.UMT5Config`` field names)."""
LORA_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
SHARD_BYTES = 5 * 10**9
WRITER_VERSION = 2
"""Part of the cache key of ``--out-dir``: bump it when what ``write_pipeline`` writes or records changes."""
DTYPE = torch.bfloat16
STRATEGIES = ("rank_local", "full", "broadcast")
LABELS = {"rank_local": "ours: rank_local", "full": "vllm-omni own load (= full)",
          "broadcast": "vllm-omni broadcast (= broadcast)"}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- sparse safetensors


def _dtype_names() -> dict[torch.dtype, str]:
    from vllm_diffusion_plugin.engine.io.headers import SAFETENSORS_DTYPES

    return {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], torch.dtype]], *,
                      fill: bool = False) -> int:
    """A safetensors file listing ``tensors`` (key, shape, dtype) in order; the data region is a hole
    (``truncate``), or zeros actually written when ``fill``. Returns the data bytes."""
    names = _dtype_names()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shape, dtype in tensors:
        size = _nbytes(shape, dtype)
        header[key] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        if fill:
            chunk = bytes(64 << 20)
            left = offset
            while left:
                f.write(chunk[:min(left, len(chunk))])
                left -= min(left, len(chunk))
        else:
            f.truncate(8 + len(blob) + offset)
    return offset


def write_sparse_component(folder: Path, config: dict, tensors: list[tuple[str, tuple[int, ...], torch.dtype]], *,
                           shard_bytes: int = SHARD_BYTES, prefix: str = "diffusion_pytorch_model") -> int:
    """``config.json`` + sparse shards of at most ``shard_bytes`` (one tensor larger gets its own) + the index
    ``<prefix>.safetensors.index.json``. Returns the data bytes."""
    shards: list[list] = [[]]
    size = 0
    for entry in tensors:
        nbytes = _nbytes(entry[1], entry[2])
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        name = f"{prefix}-{i:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(folder / name, shard)
        weight_map.update((key, name) for key, _, _ in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


# ---------------------------------------------------------------- what the components hold


def component_config(class_name: str, config: dict) -> dict:
    import diffusers

    return {"_class_name": class_name, "_diffusers_version": diffusers.__version__, **config}


def meta_module(name: str, config: dict, *, dtype: torch.dtype = DTYPE) -> torch.nn.Module:
    """The component built on ``meta`` by the project's own ``build_component`` (CheckpointError if it cannot)."""
    from vllm_diffusion_plugin.engine.io.checkpoint import ComponentSource
    from vllm_diffusion_plugin.engine.skeleton import build_component

    source = ComponentSource(name=name, folder=Path(name), files=(), format="safetensors", index=None,
                             config=MappingProxyType(config))
    return build_component(source, dtype=dtype, device="meta")


def state_tensors(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every (key, shape, dtype) of the module's state dict: what diffusers' ``save_pretrained`` writes."""
    return [(key, tuple(t.shape), t.dtype) for key, t in module.state_dict(keep_vars=True).items()]


def lora_tensors(module: torch.nn.Module, *, rank: int, targets=LORA_TARGETS, prefix: str = "transformer.",
                 dtype: torch.dtype = DTYPE) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """PEFT / diffusers LoRA keys (A, B, alpha) for every ``nn.Linear`` of every block ending with ``targets``."""
    out = []
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.Linear) and name.startswith("blocks.") and name.endswith(targets):
            out += [(f"{prefix}{name}.lora_A.weight", (rank, sub.in_features), dtype),
                    (f"{prefix}{name}.lora_B.weight", (sub.out_features, rank), dtype),
                    (f"{prefix}{name}.alpha", (), torch.float32)]
    if not out:
        raise ValueError(f"no nn.Linear of {type(module).__name__}'s blocks ends with {targets}")
    return out


def text_encoder_size(config: dict) -> int | None:
    """Bytes of the UMT5 encoder's parameters counted on ``meta`` by transformers (None without transformers);
    tied ``shared`` / ``encoder.embed_tokens`` counted once, as the checkpoint stores them."""
    try:
        from transformers import UMT5Config, UMT5EncoderModel
    except ImportError:
        return None
    with torch.device("meta"):
        model = UMT5EncoderModel(UMT5Config(**{k: v for k, v in config.items() if k != "dtype"}))
    return sum(p.numel() for p in model.parameters()) * DTYPE.itemsize


def write_pipeline(root: Path, *, transformer: dict = WAN_A14B, vae: dict | None = WAN_VAE,
                   text_encoder: dict | None = UMT5_XXL, lora_rank: int = 64,
                   shard_bytes: int = SHARD_BYTES) -> dict:
    """Write the sparse pipeline folder under ``root`` (``root/pipeline``, ``root/loras``) unless a complete one is
    there (``root/manifest.json`` written last, naming what was built). Returns the manifest."""
    manifest_path = root / "manifest.json"
    wanted = {"writer": WRITER_VERSION, "transformer": transformer, "vae": vae, "text_encoder": text_encoder,
              "lora_rank": lora_rank, "shard_bytes": shard_bytes}
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("wanted") == json.loads(json.dumps(wanted)):
            return manifest
    if root.exists():
        shutil.rmtree(root)
    pipeline, loras = root / "pipeline", root / "loras"
    started = time.perf_counter()
    import diffusers

    index = {"_class_name": "WanPipeline", "_diffusers_version": diffusers.__version__, "boundary_ratio": 0.875,
             "expand_timesteps": False, "scheduler": [None, None], "tokenizer": [None, None],
             "text_encoder": [None, None], "vae": [None, None]}
    components, skipped, lora_files = {}, {}, []
    dit_config = component_config("WanTransformer3DModel", transformer)
    for name in ("transformer", "transformer_2"):
        module = meta_module(name, dit_config)
        tensors = state_tensors(module)
        components[name] = write_sparse_component(pipeline / name, dit_config, tensors, shard_bytes=shard_bytes)
        index[name] = ["diffusers", "WanTransformer3DModel"]
        lora = loras / f"{name}_distill_rank{lora_rank}.safetensors"
        loras.mkdir(parents=True, exist_ok=True)
        write_safetensors(lora, lora_tensors(module, rank=lora_rank), fill=True)
        lora_files.append(str(lora))
        _log(f"{name}: {len(tensors)} tensors, {components[name] / 1e9:.2f} GB (holes); "
             f"LoRA {lora.stat().st_size / 1e6:.0f} MB")
    optional = {"vae": ("diffusers", "AutoencoderKLWan", vae),
                "text_encoder": ("transformers", "UMT5EncoderModel", text_encoder)}
    for name, (library, class_name, config) in optional.items():
        if config is None:
            continue
        full = component_config(class_name, config)
        try:
            module = meta_module(name, full)
        except Exception as exc:  # the plan builds its skeletons the same way: it could not plan this one
            skipped[name] = f"{class_name} ({library}): build_component on meta fails: {str(exc).splitlines()[0]}"
            size = text_encoder_size(config) if name == "text_encoder" else None
            if size is not None:
                skipped[name] += f"; it holds {size / 1e9:.2f} GB in bf16 (counted on meta by transformers)"
            _log(f"{name}: left out: {skipped[name]}")
            continue
        components[name] = write_sparse_component(pipeline / name, full, state_tensors(module),
                                                  shard_bytes=shard_bytes)
        index[name] = [library, class_name]
        _log(f"{name}: {components[name] / 1e9:.2f} GB (holes)")
    (pipeline / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    manifest = {"wanted": wanted, "pipeline": str(pipeline), "components": components, "skipped": skipped,
                "loras": lora_files, "written_s": round(time.perf_counter() - started, 2)}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# ---------------------------------------------------------------- the plans


def run_plans(manifest: dict, sizes: list[int]) -> list[dict]:
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec
    from vllm_diffusion_plugin.engine.plan import plan_load

    components = list(manifest["components"])
    specs = [LoraSpec(Path(p)) for p in manifest["loras"]]
    out = []
    for size in sizes:
        started = time.perf_counter()
        plan = plan_load(manifest["pipeline"], options=LoadOptions(), components=components, lora_specs=specs,
                         world_size=size, hsdp=HSDPConfig(replicate_size=1, shard_size=size), dtype=DTYPE,
                         device_type="cpu")
        seconds = time.perf_counter() - started
        row = {"S": size, "plan_s": round(seconds, 2), "strategies": {}}
        for strategy in STRATEGIES:
            ranks = [r for r in plan.ranks if r.strategy == strategy]
            if not ranks:
                row["strategies"][strategy] = {"unavailable": plan.unavailable.get(strategy)}
                continue
            reads = [r.bytes_read for r in ranks]
            row["strategies"][strategy] = {
                "runs": ranks[0].runs,
                "bytes_read_max": max(reads), "bytes_read_min": min(reads), "bytes_read_total": sum(reads),
                "held_max": max(sum(c.held for c in r.components) for r in ranks),
                "host_peak_max": max(r.host_peak for r in ranks),
                "first_run_peak_max": max(r.first_run_peak for r in ranks),
                "components": {c.name: {"bytes_read": c.bytes_read, "held": c.held, "peak": c.peak}
                               for c in ranks[0].components},
            }
        out.append(row)
        _log(f"S={size}: plan_load took {seconds:.2f} s")
    return out


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def format_table(rows: list[dict], manifest: dict) -> str:
    head = ("| S | per rank (max over ranks) | " + " | ".join(LABELS[s] for s in STRATEGIES) + " |\n"
            "|---|---|" + "---|" * len(STRATEGIES))
    lines = [head]
    metrics = (("bytes read", "bytes_read_max"), ("held after the load", "held_max"),
               ("host peak (planned)", "host_peak_max"))
    for row in rows:
        for label, key in metrics:
            cells = []
            for strategy in STRATEGIES:
                s = row["strategies"][strategy]
                if "runs" not in s:
                    cells.append("unavailable")
                    continue
                cell = _gb(s[key])
                if key == "bytes_read_max" and s["bytes_read_min"] != s["bytes_read_max"]:
                    cell += f" (min {_gb(s['bytes_read_min'])})"
                if s["runs"] != strategy:
                    cell += f" (runs {s['runs']})"
                cells.append(cell)
            lines.append(f"| {row['S']} | {label} | " + " | ".join(cells) + " |")
    sizes = ", ".join(f"{name} {_gb(n)}" for name, n in manifest["components"].items())
    lines.append("")
    lines.append(f"Components planned: {sizes} (checkpoint bytes, bf16; DiTs sharded over S, the rest whole on "
                 f"every rank); LoRAs: {', '.join(Path(p).name for p in manifest['loras'])}.")
    for name, why in manifest["skipped"].items():
        lines.append(f"Left out: {name}: {why}.")
    lines.append("plan_load wall seconds: " + ", ".join(f"S={r['S']} {r['plan_s']:.2f} s" for r in rows) + ".")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/vllm-diffusion-real-size"))
    parser.add_argument("--sizes", default="1,4,8", help="comma list of S (world size = shard size, replicate 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    charts.add_plot_option(parser)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        parser.error(f"--sizes {args.sizes!r}: positive integers expected")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    manifest = write_pipeline(args.out_dir)
    disk = sum(p.stat().st_blocks * 512 for p in Path(manifest["pipeline"]).rglob("*") if p.is_file())
    _log(f"folder {manifest['pipeline']}: {disk / 1e6:.1f} MB on disk")
    rows = run_plans(manifest, sizes)
    report = {"manifest": manifest, "pipeline_disk_bytes": disk, "plans": rows}
    print(json.dumps(report, indent=2) if args.json else format_table(rows, manifest))
    if args.plot:
        charts.plot("plan_real_size", report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
