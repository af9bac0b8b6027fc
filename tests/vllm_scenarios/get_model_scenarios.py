"""Runs real vLLM ``get_model()`` on CPU for several load scenarios in ONE fresh process and saves results.

vLLM's distributed init happens once per process and keeps a default process group, so these scenarios run
apart from the rest of the suite: ``python get_model_scenarios.py SPEC.json OUT_DIR``. SPEC is a list of
``{"name", "model", "load_format", "extra", "reload", "dtype"}`` (dtype: ``float32`` unless given); for each, OUT_DIR/<name>.pt holds the parameters
(DTensors gathered), the logits of a fixed hidden state (unsharded models), and any error's type and message.
``"reload": true``: after the load, every parameter is zeroed and vLLM's own in-place reload
(``reload_weights``, vLLM 0.34+, which streams the loader's ``get_all_weights``) must bring the model back;
on a vLLM without it the result is ``{"skipped": reason}``.
"""

import json
import os
from pathlib import Path
import sys
import traceback

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# vLLM 0.34's CPU platform refuses x86 without an active Triton driver ("vLLM on x86 CPUs requires Triton
# (triton-cpu)", platforms/cpu.py) unless no CUDA device is visible on purpose (triton_utils/importing.py keeps
# Triton then). This host has no GPU: say so. No effect on vLLM 0.30-0.33.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ["VLLM_DIFFUSION_PLUGIN"] = "1"

import torch  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.model_loader import get_model  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402

from cpu_ops import ensure_cpu_ops  # noqa: E402  (next to this file)




class ReloadUnavailable(Exception):
    pass


def reload_in_place(vc, model) -> None:
    """Zero every parameter, then vLLM's in-place reload from the checkpoint (the loader's get_all_weights)."""
    try:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
    except ImportError as exc:
        import vllm

        raise ReloadUnavailable(f"vLLM {vllm.__version__} has no in-place weight reload ({exc})") from exc
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    reload_weights(vc, model, weights_iterator=None, weights_path=None, is_checkpoint_format=True)


def main(spec_path: str, out_dir: str) -> None:
    ensure_cpu_ops()  # vLLM 0.30-0.32 with the PyPI wheel on a CPU host: see cpu_ops.py
    load_general_plugins()  # discovers and runs our entry point, as every vLLM process does
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"file://{Path(out_dir) / 'store'}", backend="gloo")
    initialized = False
    hidden = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    for scenario in json.loads(open(spec_path).read()):
        result = {}
        try:
            vc = EngineArgs(model=scenario["model"], load_format=scenario["load_format"],
                            model_loader_extra_config=scenario.get("extra") or {}, skip_tokenizer_init=True,
                            dtype=scenario.get("dtype", "float32"), max_model_len=128).create_engine_config()
            with set_current_vllm_config(vc):
                if not initialized:
                    initialize_model_parallel(1, 1)
                    initialized = True
                model = get_model(vllm_config=vc)
                if scenario.get("reload"):
                    reload_in_place(vc, model)
                params = {}
                for name, p in model.named_parameters():
                    is_dtensor = hasattr(p, "full_tensor")
                    params[name] = (p.full_tensor() if is_dtensor else p).detach().clone()
                    result.setdefault("dtensors", []).extend([name] if is_dtensor else [])
                result["params"] = params
                if not result.get("dtensors"):  # FSDP unshards in forward(), not in compute_logits()
                    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
                    result["logits"] = model.compute_logits(hidden.to(dtype)).detach().clone()
                result["loader"] = type(model).__name__
        except ReloadUnavailable as exc:
            result = {"skipped": str(exc)}
        except Exception as exc:  # recorded for the test to assert on
            result = {"error_type": type(exc).__name__, "error": str(exc), "traceback": traceback.format_exc()}
        torch.save(result, os.path.join(out_dir, scenario["name"] + ".pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
