"""The CLI and load path as a new user meets them (issue 14): each finding pinned by a test.

In-process ``cli.main`` where the behaviour is one process's; subprocesses of the real command where ranks,
signals or a missing module are the point. Each of these failed on the code before the fix.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fault_cli import finish, held_load, left_behind
from safetensors.torch import load_file, save_file

from vllm_diffusion_plugin.doors import cli
from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora

CLI = [sys.executable, "-m", "vllm_diffusion_plugin.doors.cli"]
LOAD = ("--device", "cpu", "--dtype", "float32")


def _env() -> dict:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("VLLM_DIFFUSION") and k != "VLLM_CONFIGURE_LOGGING"}


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=_env())


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("vllm-diffusion: ")]


@pytest.fixture(autouse=True)
def keep_vllm_logging(monkeypatch):
    """In-process runs must not point vLLM's log handler at this test's captured stderr (closed afterwards)."""
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")


@pytest.fixture
def no_base_read(monkeypatch):
    """Fail the test if any base weight is read (the error must come before)."""
    from vllm_diffusion_plugin.engine.io import stream as weights

    def read(*args, **kwargs):
        raise AssertionError("a base weight was read before the bad input was reported")

    monkeypatch.setattr(weights, "_iter_file", read)


# ---- 1. a LoRA silently dropped -------------------------------------------------------------------------
def test_bare_dit_folder_named_after_the_model_gets_its_lora(tiny_wan_dir, tmp_path, capsys):
    dit = tmp_path / "Wan2.2-T2V-tiny"  # a standalone DiT download, named after the model
    shutil.copytree(tiny_wan_dir / "transformer", dit)
    lora = write_tiny_lora(tmp_path / "lora.safetensors", build_tiny_model("wan"), seed=3)
    assert cli.main(["load", str(dit), f"--lora={lora}", *LOAD, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["components"][0]["name"] == "Wan2.2-T2V-tiny"
    assert report["lora_keys_fused"] == 16


@pytest.mark.multiproc
def test_bare_dit_folder_is_sharded_under_two_ranks(tiny_wan_dir, tmp_path):
    dit = tmp_path / "Wan2.2-T2V-tiny"
    shutil.copytree(tiny_wan_dir / "transformer", dit)
    proc = run_cli("load", str(dit), "--nproc", "2", *LOAD, "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    component = json.loads(proc.stdout)["components"][0]
    assert component["sharded_blocks"] > 0 and component["param_bytes_local"] < component["param_bytes_total"]


def test_lora_without_any_dit_loaded_is_an_error(tiny_wan_dir, tmp_path, capsys):
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec, assign_loras

    with pytest.raises(ValueError, match="no DiT"):
        assign_loras([LoraSpec(tmp_path)], [])


@pytest.mark.parametrize(("text", "match"), [
    ("=LORA", "empty component name before '='"),
    ("LORA@abc", "the scale 'abc' after '@' is not a number"),
    ("transformer=LORA@", "the scale '' after '@' is not a number"),
])
def test_a_malformed_lora_spec_is_an_error_naming_it(tmp_path, text, match):
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec

    lora = tmp_path / "distill.safetensors"
    lora.write_bytes(b"")
    with pytest.raises(ValueError, match=match):
        LoraSpec.parse(text.replace("LORA", str(lora)))


def test_an_at_sign_in_a_lora_file_name_stays_in_the_path(tmp_path):
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec

    lora = tmp_path / "wan@lightx2v.safetensors"
    lora.write_bytes(b"")
    assert LoraSpec.parse(str(lora)) == LoraSpec(lora, 1.0, None)
    assert LoraSpec.parse(f"transformer_2={lora}@0.5", default_scale=0.5) == LoraSpec(lora, 0.25, "transformer_2")


def test_a_lora_file_that_fuses_nothing_is_an_error_naming_it(tiny_wan_dir, tmp_path, capsys):
    empty = tmp_path / "empty_lora.safetensors"
    save_file({}, str(empty))
    assert cli.main(["load", str(tiny_wan_dir), "--component", "transformer", f"--lora={empty}", *LOAD]) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert str(empty) in line and "fuses no target" in line


def test_zero_targets_in_the_vllm_door_fusion_and_lora_strict_false(tmp_path, caplog):
    """The vLLM loader fuses through ``fuse_lora_files``: the same rule, a warning with strict=False."""
    from vllm_diffusion_plugin.engine.lora import NoLoraTargetsError, fuse_lora_files
    from vllm_diffusion_plugin.testing.logs import captured_logs

    model = build_tiny_model("wan")
    empty, foreign = tmp_path / "empty.safetensors", tmp_path / "foreign.safetensors"
    save_file({}, str(empty))
    save_file({"text_model.encoder.layers.0.q.lora_A.weight": torch.zeros(2, 3),
               "text_model.encoder.layers.0.q.lora_B.weight": torch.zeros(3, 2)}, str(foreign))
    with pytest.raises(NoLoraTargetsError, match=str(empty)):
        fuse_lora_files(model, [(empty, 1.0)])
    with captured_logs("vllm_diffusion_plugin") as logs:
        stats = fuse_lora_files(model, [(foreign, 1.0)], strict=False)
    assert stats.targets == 0
    assert any(str(foreign) in m and "fuses no target" in m for m in logs.messages(logging.WARNING))


def test_zero_targets_in_the_vllm_omni_door_fusion(tiny_wan_dir, tmp_path):
    """The vllm-omni door validates its LoRA files through the same rule before any base weight is read."""
    from vllm_diffusion_plugin.engine.fused_stream import lora_fuser
    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint
    from vllm_diffusion_plugin.engine.lora import NoLoraTargetsError

    (source,) = resolve_checkpoint(tiny_wan_dir, components=["transformer"])
    empty = tmp_path / "empty.safetensors"
    save_file({}, str(empty))
    with pytest.raises(NoLoraTargetsError, match=str(empty)):
        lora_fuser(source, [(str(empty), 1.0)], dtype=torch.float32, strict=True, chunk_mb=64)
    fuser = lora_fuser(source, [(str(empty), 1.0)], dtype=torch.float32, strict=False, chunk_mb=64)
    assert fuser.deltas == [{}]


# ---- 2. errors inside ranks ----------------------------------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host where --device cuda is not usable")
def test_an_error_inside_ranks_is_the_same_one_line_as_with_one_rank(tiny_wan_dir):
    args = ["load", str(tiny_wan_dir), "--component", "transformer", "--device", "cuda"]
    one, two = run_cli(*args), run_cli(*args, "--nproc", "2", timeout=600)
    assert one.returncode == two.returncode == 1, two.stderr[-3000:]
    assert "Traceback" not in two.stderr and "ProcessRaisedException" not in two.stderr, two.stderr[-3000:]
    # each rank names its own device (cuda:0 or cuda:1); whichever rank failed first is reported
    assert [re.sub(r"cuda:\d", "cuda:N", line) for line in error_lines(two.stderr)] == \
        [re.sub(r"cuda:\d", "cuda:N", line) for line in error_lines(one.stderr)]
    assert len(error_lines(one.stderr)) == 1 and "not usable" in one.stderr


# ---- 3. late validation -------------------------------------------------------------------------------
def _bad_shape_lora(tmp_path: Path) -> Path:
    path = write_tiny_lora(tmp_path / "bad_shape.safetensors", build_tiny_model("wan"), seed=4)
    tensors = load_file(str(path))
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("case", ["shape", "pickle", "html", "unwritable"])
def test_bad_input_is_reported_before_any_base_weight_is_read(tiny_wan_dir, tmp_path, capsys, no_base_read, case):
    good = write_tiny_lora(tmp_path / "good.safetensors", build_tiny_model("wan"), seed=1)
    extra: list[str] = []
    if case == "shape":  # the second transformer's LoRA: today found only after the first was read
        bad, expected = _bad_shape_lora(tmp_path), "shape mismatch"
    elif case == "pickle":
        bad, expected = tmp_path / "lora.bin", "not a .safetensors file"
        torch.save({"x": torch.zeros(1)}, bad)
    elif case == "html":
        bad, expected = tmp_path / "lora.safetensors", "lora.safetensors"
        bad.write_text("<!DOCTYPE html><html><body>Access denied</body></html>\n" * 3)
    else:
        bad, expected = tmp_path / "lora_b.safetensors", "cannot write there"
        shutil.copy(good, bad)
        (tmp_path / "a-file").write_text("")
        extra = ["--save-fused", str(tmp_path / "a-file" / "out")]
    assert cli.main(["load", str(tiny_wan_dir), f"--lora={good}", f"--lora={bad}", *LOAD, *extra]) == 1
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert expected in line and "Traceback" not in err


def test_html_page_saved_as_base_weights_is_one_line_naming_the_file(tiny_wan_dir, copy_checkpoint, capsys):
    root = copy_checkpoint(tiny_wan_dir)
    shard = sorted((root / "transformer").glob("*.safetensors"))[0]
    shard.write_text("<html><head><title>404</title></head><body>Not Found</body></html>")
    assert cli.main(["load", str(root), *LOAD]) == 1
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert str(shard) in line and "Traceback" not in err


# ---- 4. --save-fused writes a complete pipeline, atomically ------------------------------------------------
@pytest.fixture
def wan_with_scheduler(tiny_wan_dir, copy_checkpoint) -> Path:
    from diffusers import UniPCMultistepScheduler

    root = copy_checkpoint(tiny_wan_dir)
    UniPCMultistepScheduler(flow_shift=3.0).save_pretrained(root / "scheduler")
    index = json.loads((root / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "UniPCMultistepScheduler"]
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def test_save_fused_from_a_pipeline_writes_a_loadable_pipeline(wan_with_scheduler, tmp_path, capsys):
    import diffusers

    out = tmp_path / "fused"
    lora = write_tiny_lora(tmp_path / "lora.safetensors", build_tiny_model("wan"), seed=3)
    assert cli.main(["load", str(wan_with_scheduler), f"--lora={lora}", *LOAD, "--save-fused", str(out)]) == 0
    assert (out / "model_index.json").read_bytes() == (wan_with_scheduler / "model_index.json").read_bytes()
    config = out / "scheduler" / "scheduler_config.json"
    assert config.read_bytes() == (wan_with_scheduler / "scheduler" / "scheduler_config.json").read_bytes()
    assert os.stat(config).st_ino == os.stat(wan_with_scheduler / "scheduler" / "scheduler_config.json").st_ino
    pipe = diffusers.DiffusionPipeline.from_pretrained(out, vae=None, text_encoder=None, tokenizer=None)
    assert type(pipe.transformer).__name__ == "WanTransformer3DModel" and pipe.scheduler is not None
    assert not torch.equal(pipe.transformer.blocks[0].attn1.to_q.weight,  # the LoRA is in the saved weights
                           diffusers.WanTransformer3DModel.from_pretrained(
                               wan_with_scheduler / "transformer").blocks[0].attn1.to_q.weight)
    capsys.readouterr()
    assert cli.main(["load", str(out), *LOAD, "--json"]) == 0
    assert [c["name"] for c in json.loads(capsys.readouterr().out)["components"]] == ["transformer",
                                                                                       "transformer_2"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_failed_save_leaves_nothing_half_written(wan_with_scheduler, tmp_path, monkeypatch, capsys):
    from vllm_diffusion_plugin.engine import save as skeleton

    real, calls = skeleton.save_component, []

    def fail_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(skeleton, "save_component", fail_second)
    out = tmp_path / "fused"
    assert cli.main(["load", str(wan_with_scheduler), *LOAD, "--save-fused", str(out)]) == 1
    assert "No space left" in error_lines(capsys.readouterr().err)[0]
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ---- 5. interrupts --------------------------------------------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_launcher_stops_every_rank_and_writes_nothing(tiny_wan_dir, tmp_path, signum, code):
    """Both ranks inside the load when the signal comes (rank 1 held in its read, rank 0 waiting for it in a
    collective: ``fault_hooks.py``), not racing a tiny load that may end within a second of the ranks' start."""
    proc, tmp, out, ranks, _ = held_load(tiny_wan_dir, tmp_path)
    try:
        proc.send_signal(signum)  # the launcher alone, as `kill PID` does
        err = finish(proc, tmp_path, timeout_s=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "interrupted" in error_lines(err)[-1]
    assert left_behind(proc.processes, tmp, out) == []  # the ranks, and the fork server they came from


@pytest.mark.multiproc
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_local_ranks_start_with_torch_the_engine_and_the_checkpoints_classes_imported(tiny_wan_dir, tmp_path):
    """Issue 48: a rank of ``--nproc 2`` is forked from a fork server that imported what a rank needs once, beside
    the launcher's own imports; it does not import torch, the engine or the diffusers classes again. Each rank says
    what it started with (``fault_hooks.py``, run as the rank's ``__main__`` before the rank's own code). Before: every rank was a fresh interpreter (spawn) that imported all of it again -- seconds
    of CPU each, after the launcher had: a 2-rank load of a tiny model took ~1.6x a 1-rank one."""
    hooks = Path(__file__).resolve().parent / "fault_hooks.py"
    env = {**_env(), "FAULT_DIR": str(tmp_path), "FAULT_MARK_START": "1",
           "PYTHONPATH": os.pathsep.join([str(hooks.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(hooks), "load", str(tiny_wan_dir), "--nproc", "2", *LOAD, "--json"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    marks = [json.loads(p.read_text()) for p in tmp_path.glob("start-*.json")]
    assert len(marks) == 2, marks
    for mark in marks:
        assert mark["imported"] == ["torch", "torch.distributed.fsdp", "vllm_diffusion_plugin.engine.session",
                                    "vllm_diffusion_plugin.doors.cli.load", "WanTransformer3DModel"], mark
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_ctrl_c_while_the_command_starts_is_one_line_and_exit_130(tiny_wan_dir, tmp_path):
    """SIGINT a second into the command: it is still importing (torch, vLLM, diffusers: seconds), before any rank or
    server exists. Before: a KeyboardInterrupt traceback from inside an import and exit 1 -- what a `demo --serve`
    interrupted early on a busy host printed too."""
    out = tmp_path / "out"
    proc = subprocess.Popen([*CLI, "load", str(tiny_wan_dir), "--nproc", "2", *LOAD, "--save-fused", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "vllm-diffusion: interrupted (SIGINT)", err[-3000:]
    assert not out.exists()


# ---- 7. noise and help --------------------------------------------------------------------------------
def test_help_describes_every_flag_and_shows_its_default():
    parser = cli._parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subparsers.items():
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if action.dest == "help":
                continue
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"
        assert "(default: bfloat16)" in text or name != "load"
        assert "(default: auto)" in text or name != "load"


def test_pickle_refusal_names_the_switch_of_each_door(tiny_checkpoint_factory, capsys):
    from vllm_diffusion_plugin.engine.errors import PickleRefusedError
    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint

    root = tiny_checkpoint_factory("flux", safe_serialization=False)
    assert cli.main(["load", str(root), *LOAD]) == 1
    assert "--allow-pickle" in error_lines(capsys.readouterr().err)[0]
    with pytest.raises(PickleRefusedError) as info:
        resolve_checkpoint(root)
    assert "allow_pickle" in str(info.value.with_how('add "allow_pickle": true to --model-loader-extra-config'))


def test_a_missing_relative_path_is_a_missing_folder_not_a_hub_lookup(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    for missing in ("checkpoints/wan-tiny", "wan-tiny"):
        assert cli.main(["load", missing, *LOAD]) == 1
        (line,) = error_lines(capsys.readouterr().err)
        assert f"checkpoint folder {missing} does not exist" in line and "Hub" not in line


def test_tiny_models_print_sizes_in_human_units(tiny_wan_dir):
    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint
    from vllm_diffusion_plugin.engine.memory import human_count
    from vllm_diffusion_plugin.engine.skeleton import build_component
    from vllm_diffusion_plugin.testing.logs import captured_logs

    assert [human_count(n) for n in (950, 12_345, 4_500_000, 14_000_000_000)] == ["950", "12.3K", "4.5M", "14B"]
    with captured_logs("vllm_diffusion_plugin") as logs:
        build_component(resolve_checkpoint(tiny_wan_dir)[0], dtype=torch.float32, device="meta")
    (message,) = [m for m in logs.messages(logging.INFO) if "parameters" in m]
    assert "0.000B" not in message and "K parameters" in message


def test_the_table_names_what_the_lora_column_counts(tiny_wan_dir, tmp_path, capsys):
    lora = write_tiny_lora(tmp_path / "lora.safetensors", build_tiny_model("wan"), seed=3)
    assert cli.main(["load", str(tiny_wan_dir), "--component", "transformer", f"--lora={lora}", *LOAD]) == 0
    table = capsys.readouterr().out
    assert "lora targets" in table and "lora keys" not in table


def test_third_party_noise_and_our_info_lines_are_hidden_unless_verbose(tiny_wan_dir):
    args = ["load", str(tiny_wan_dir), "--component", "transformer", *LOAD]
    quiet, verbose = run_cli(*args), run_cli(*args, "--verbose")
    assert quiet.returncode == verbose.returncode == 0, quiet.stderr[-3000:]
    noise = ("is deprecated", "Failed to import from vllm._C", "No CUDA runtime")
    assert not [line for line in quiet.stderr.splitlines() if any(n in line for n in noise)], quiet.stderr[-3000:]
    ours = [line for line in quiet.stderr.splitlines() if " INFO " in line]
    assert not ours, quiet.stderr[-3000:]  # the table on stdout is what the command is run for
    assert "lora targets" in quiet.stdout
    assert "diffusion-hsdp load report: component=transformer rank=0 world_size=1 " in verbose.stderr
    assert "Built WanTransformer3DModel" in verbose.stderr


def test_without_verbose_our_warnings_still_show():
    script = ("from vllm_diffusion_plugin.doors.cli.noise import quiet_third_party\n"
              "from vllm_diffusion_plugin._logging import init_logger\n"
              "quiet_third_party(verbose=False)\n"
              "log = init_logger('vllm_diffusion_plugin.engine.weights')\n"
              "log.info('INFO-MARK'); log.warning('WARNING-MARK'); log.error('ERROR-MARK')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WARNING-MARK" in proc.stderr and "ERROR-MARK" in proc.stderr and "INFO-MARK" not in proc.stderr


# ---- 9. the CLI without its extra -----------------------------------------------------------------------
BLOCK_DIFFUSERS = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "diffusers" or name.startswith("diffusers."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocker())
from vllm_diffusion_plugin.doors.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("args", [["demo"], ["load", "some/folder"]])
def test_without_diffusers_the_command_names_the_extra_in_one_line(args):
    proc = subprocess.run([sys.executable, "-c", BLOCK_DIFFUSERS, *args], capture_output=True, text=True,
                          timeout=300, env=_env())
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    assert 'pip install "vllm-diffusion-plugin[cli]"' in line


# ---- 6. progress on long work ---------------------------------------------------------------------------
class _Terminal:
    """A stderr that says it is a terminal and keeps what is written."""

    def __init__(self) -> None:
        self.text = []

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.text.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("progress", [True, False])
def test_progress_bars_for_reading_fusing_and_saving_on_a_terminal(tiny_wan_dir, tmp_path, monkeypatch, progress):
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec
    from vllm_diffusion_plugin.engine.session import load_components
    from vllm_diffusion_plugin.engine.save import save_components

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    lora = write_tiny_lora(tmp_path / "lora.safetensors", build_tiny_model("wan"), seed=3)
    loaded = load_components(tiny_wan_dir, options=LoadOptions(), components=["transformer"],
                             device=torch.device("cpu"), dtype=torch.float32, lora_specs=[LoraSpec(lora)],
                             progress=progress)
    save_components(loaded, tmp_path / "out")
    text = "".join(terminal.text)
    bars = ("Loading transformer", "Fusing LoRA into transformer", "Saving transformer")
    assert [bar in text for bar in bars] == [progress] * 3, text[-2000:]
