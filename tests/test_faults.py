"""Faults during a load (issue 36, part 2), the CLI door: a checkpoint shard truncated or replaced after its header
was read and before its bytes are is named in one line, every rank exits, nothing is written -- never loaded as
wrong weights. The break is made in each rank right before its read step (``weights.load_into_module``), by a
wrapper script whose top level every spawned rank runs too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOK = '''
import os, sys
from fault_cli import break_file
from vllm_diffusion_plugin.engine import weights

MODE = os.environ["FAULT_MODE"]
original = weights.load_into_module


def break_then_read(module, *args, source, **kwargs):
    """The first read of this rank: break the component's first shard, then read it."""
    if source.files and not getattr(break_then_read, "done", False):
        break_then_read.done = True
        break_file(sorted(source.files)[0], MODE)
    return original(module, *args, source=source, **kwargs)


weights.load_into_module = break_then_read
if __name__ == "__main__":
    from vllm_diffusion_plugin.doors import cli

    sys.exit(cli.main(sys.argv[1:]))
'''


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("mode", ["truncate", "replace"])
def test_a_shard_changed_between_its_header_and_its_bytes_is_named_and_nothing_is_written(
        tiny_wan_dir, tmp_path, mode, nproc):
    """Before: a truncated shard failed with torch's "Trying to resize storage that is not resizable" (no file
    named); a replaced one of the same size loaded its zeros as the weights, exit 0, ``--save-fused`` written."""
    checkpoint = tmp_path / "wan"
    shutil.copytree(tiny_wan_dir, checkpoint)
    (tmp_path / "hook.py").write_text(HOOK)
    out = tmp_path / "fused"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION")}
    env.update(FAULT_MODE=mode,
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(tmp_path / "hook.py"), "load", str(checkpoint), "--device", "cpu",
                           "--dtype", "float32", "--nproc", str(nproc), "--save-fused", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("vllm-diffusion: ")]
    assert proc.returncode == 1 and len(errors) == 1, (proc.returncode, proc.stderr[-3000:])
    shard = sorted((checkpoint / "transformer").glob("*.safetensors"))[0]
    assert f"{shard} changed while the load of transformer read it" in errors[0], errors[0]
    # a file renamed over the shard may get the freed inode number back (at 2 ranks each rank replaces it): then
    # it reads as the same file rewritten -- named and refused all the same
    words = ("truncated",) if mode == "truncate" else ("replaced by another file", "rewritten in place")
    assert any(word in errors[0] for word in words), errors[0]
    assert not out.exists() and not list(tmp_path.glob(".fused.partial-*")), list(tmp_path.iterdir())
