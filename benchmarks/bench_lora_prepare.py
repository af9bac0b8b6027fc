"""Read + normalize + fuse of a Wan2.2 A14B-sized distill LoRA: this tree against another, as ratios in one run.

The LoRA: rank 64, bf16, LightX2V naming (``diffusion_model.blocks.N.self_attn.q.lora_down.weight`` ...,
``.alpha``), on every attention (self and cross: q, k, v, o) and FFN (``ffn.0``, ``ffn.2``) linear of the 40
blocks of a Wan2.2 A14B transformer (dim 5120, ffn 13824): 400 targets, ~620 MB, written once into ``--work``.

Per round, in a fresh process for each tree (imports and page cache alike for both; the file is read warm):

- read: ``lora.load_lora`` of the file;
- normalize: ``lora.prepare_lora_files`` against the transformer's skeleton on ``meta`` (every key, rank, shape
  and finiteness check; the diffusers converter where the tree has one);
- fuse: the deltas of block 0 fused into a real bf16 block of the same width (``fuse_prepared``, CPU path), times
  40 for the transformer (a 40-block bf16 A14B transformer is 28 GB, more than this host has).

Rounds alternate the trees; the median of each is kept. Goal: this tree's read + normalize + fuse no more than
1.1x the other's (issue 21). Usage::

    python benchmarks/bench_lora_prepare.py --ref-tree /path/to/other/checkout [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DIM, FFN, BLOCKS, RANK = 5120, 13824, 40, 64
CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
              text_dim=4096, freq_dim=256, ffn_dim=FFN, num_layers=BLOCKS, cross_attn_norm=True, eps=1e-6,
              rope_max_seq_len=1024)
HERE = Path(__file__).resolve().parents[1]


def write_lora(path: Path, *, blocks: int = BLOCKS, seed: int = 0) -> Path:
    """The LoRA described in the module docstring for ``blocks`` blocks (``bench_serve_startup`` writes one per
    transformer of a narrower-in-depth pipeline), unless ``path`` exists."""
    import torch
    from safetensors.torch import save_file

    if path.exists():
        return path
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    linears = [(f"{attn}.{p}", DIM, DIM) for attn in ("self_attn", "cross_attn") for p in "qkvo"]
    linears += [("ffn.0", FFN, DIM), ("ffn.2", DIM, FFN)]
    for block in range(blocks):
        for name, out_f, in_f in linears:
            key = f"diffusion_model.blocks.{block}.{name}"
            tensors[f"{key}.lora_down.weight"] = (torch.randn(RANK, in_f, generator=gen) * 0.01).bfloat16()
            tensors[f"{key}.lora_up.weight"] = (torch.randn(out_f, RANK, generator=gen) * 0.01).bfloat16()
            tensors[f"{key}.alpha"] = torch.tensor(float(RANK))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)  # a cached file is always complete
    return path


def measure(lora: str) -> dict[str, float]:
    """One round in this process (run by ``--measure``)."""
    import torch
    from diffusers import WanTransformer3DModel

    from vllm_diffusion_plugin.engine.lora import fuse_prepared, load_lora, prepare_lora_files

    torch.set_num_threads(1)
    with torch.device("meta"):
        skeleton = WanTransformer3DModel(**CONFIG)
    start = time.perf_counter()
    load_lora(lora)
    read = time.perf_counter() - start
    start = time.perf_counter()
    (prepared,) = prepare_lora_files(skeleton, [(lora, 1.0)])
    normalize = time.perf_counter() - start - read  # prepare reads the file again, warm
    one_block = WanTransformer3DModel(**{**CONFIG, "num_layers": 1}).to(torch.bfloat16).requires_grad_(False)
    block0 = type(prepared)(prepared.path, prepared.scale,
                            {k: v for k, v in prepared.deltas.items() if k.startswith("blocks.0.")})
    start = time.perf_counter()
    fuse_prepared(one_block, [block0])
    fuse = (time.perf_counter() - start) * BLOCKS
    return {"read": read, "normalize": normalize, "fuse (x40)": fuse, "total": read + normalize + fuse}


def run_tree(tree: Path, lora: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, __file__, "--measure", str(lora)], env=env, capture_output=True,
                          text=True, timeout=1800, cwd=tree)
    if proc.returncode != 0:
        raise RuntimeError(f"round in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref-tree", type=Path, required=False, help="the other checkout (e.g. a worktree of main)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-lora-prepare"), help="where the LoRA is kept")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--measure", metavar="LORA", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return 0
    lora = write_lora(args.work / "a14b_distill_rank64.safetensors")
    trees = {"this": HERE, **({"ref": args.ref_tree.resolve()} if args.ref_tree else {})}
    rounds: dict[str, list[dict]] = {name: [] for name in trees}
    for i in range(args.rounds):
        for name in (list(trees) if i % 2 == 0 else list(reversed(trees))):
            rounds[name].append(run_tree(trees[name], lora))
    median = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in rounds.items()}
    report = {"lora_bytes": lora.stat().st_size, "rounds": rounds, "median": median}
    if "ref" in median:
        ratio = median["this"]["total"] / median["ref"]["total"]
        report["goal"] = {"goal": "this tree's read + normalize + fuse <= 1.1x the ref tree's", "ratio": ratio,
                          "pass": ratio <= 1.1}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"LoRA {report['lora_bytes'] / 1e6:.0f} MB, {args.rounds} rounds, medians (s):")
        for name, m in median.items():
            print(f"  {name:<5} " + ", ".join(f"{k} {v:.2f}" for k, v in m.items()))
        if "goal" in report:
            g = report["goal"]
            print(f"  {g['goal']}: {g['ratio']:.3f}x {'PASS' if g['pass'] else 'FAIL'}")
    return 0 if report.get("goal", {}).get("pass", True) else 1


if __name__ == "__main__":
    sys.exit(main())
