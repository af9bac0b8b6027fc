"""``vllm-diffusion demo --serve``: the project's main job on a tiny default -- ``vllm serve DIR --omni
--load-format diffusion-hsdp`` with one LoRA per transformer, one video request, the video written, stopped.

Writes the tiny runnable Wan2.2 pipeline and its two LoRAs (``tiny.serve_checkpoints``, the serving proof's),
starts the server on 127.0.0.1 through ``tools.servers`` (the benchmark's and the proof's server code: own
process group, bounded waits, the whole group stopped at the end and on Ctrl-C / SIGTERM), on this package's CPU
platform where CUDA is not available, sends the video request and writes the mp4 into the working folder.
Prints the ready time, the workers' load report lines as a table, and the video's path. Needs the ``[omni]``
extra (vLLM 0.30 + vllm-omni 0.30).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

from vllm_diffusion_plugin.tiny.serve_checkpoints import build_checkpoints
from vllm_diffusion_plugin.tools import servers

OMNI_EXTRA_HINT = 'pip install "vllm-diffusion-plugin[omni]" (from a checkout: pip install -e ".[omni]")'
VIDEO_NAME = "vllm-diffusion-demo.mp4"
REPORT_COLUMNS = ("component", "rank", "strategy", "bytes_read", "read_s", "lora_s", "total_s")


class MissingOmni(RuntimeError):
    """vllm-omni is not importable here."""


def check_omni() -> None:
    if importlib.util.find_spec("vllm_omni") is None:
        raise MissingOmni(f"demo --serve starts vllm-omni's server, and vllm-omni is not installed in "
                          f"{sys.prefix}: install .[omni] -- {OMNI_EXTRA_HINT}")


def report_table(reports: list[dict[str, str]]) -> str:
    """The workers' ``diffusion-hsdp load report:`` lines (parsed) as a short table."""
    rows = [REPORT_COLUMNS] + [tuple(r.get(c, "-") for c in REPORT_COLUMNS) for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(REPORT_COLUMNS))]
    return "\n".join("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def run(*, nproc: int = 1, keep: Path | None = None, out_dir: Path | None = None, ready_timeout_s: float = 900.0,
        say=print) -> Path:
    """Build, serve, request, stop; returns the video's path (``out_dir``, default the working folder)."""
    check_omni()
    import torch

    if nproc not in (1, 2):
        raise ValueError(f"demo --serve runs 1 or 2 ranks, got --nproc {nproc}")
    out = Path(out_dir or Path.cwd()).resolve()
    with tempfile.TemporaryDirectory(prefix="vllm-diffusion-serve-demo-") as tmp:
        root = Path(keep or tmp).resolve()
        t0 = time.monotonic()
        ckpt = build_checkpoints(root / "checkpoints", merged=False)
        say(f"demo pipeline: {ckpt.original} (+ LoRAs {ckpt.lora_high.name}, {ckpt.lora_low.name}), written in "
            f"{time.monotonic() - t0:.1f} s")
        options = {"lora_path": [f"transformer={ckpt.lora_high}", f"transformer_2={ckpt.lora_low}"]}
        args = ["--load-format", "diffusion-hsdp"]
        if nproc == 2:
            args += ["--use-hsdp", "--hsdp-shard-size", "2"]
            options["hsdp_weight_load"] = "rank_local"
        spec = servers.ServerSpec("demo-serve", ckpt.original, plugin=True,
                                  args=(*args, "--additional-config", json.dumps({"diffusion_hsdp": options})))
        cpu = not torch.cuda.is_available()
        say(f"starting: vllm serve {ckpt.original.name} --omni {' '.join(args)} --additional-config '...' on "
            f"127.0.0.1 ({'CPU platform' if cpu else 'GPU'}), log {root / 'logs' / 'demo-serve.log'}")
        result = servers.serve(spec, root / "logs", cpu=cpu, ready_timeout_s=ready_timeout_s,
                               request_timeout_s=ready_timeout_s)
        reports = servers.load_reports(result.log_text())
        video = out / VIDEO_NAME
        video.write_bytes(result.answers[0])
    say(f"ready after {result.ready_s:.1f} s; video request answered in {result.request_s[0]:.1f} s")
    say("load report (each worker, each DiT):")
    say(report_table(reports))
    say(f"video: {video} ({video.stat().st_size} bytes); server stopped")
    return video
