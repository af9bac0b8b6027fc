#!/usr/bin/env python3
"""Real ``vllm serve`` servers with ``--load-format diffusion-hsdp`` (the vLLM door), against vLLM's default loader.

    python tests/e2e/serve_lora_e2e.py --python .venv-omni32/bin/python [--keep] [--json]

1. ``build`` (run in the serving interpreter: torch, transformers, peft and this plugin): a tiny
   ``Qwen2ForCausalLM`` (hidden 128, head_dim 64, GQA 2q/1kv heads, q/k/v biases, 2 layers) with a byte-level
   BPE tokenizer trained here, saved sharded by transformers; a PEFT LoRA (r=8, alpha 16 on q/k/v/o/gate/up/down,
   random non-zero B) saved by peft; the same adapter as one kohya file (``lora_unet_<module>.lora_down`` /
   ``lora_up`` / ``.alpha``); the checkpoint merged by peft's ``merge_and_unload()``; a bad adapter (one
   ``lora_B`` of the wrong shape); transformers' greedy continuations of the prompts.
2. ``Server``: ``vllm serve MODEL ...`` (the console script next to the interpreter; ``python -m
   vllm.entrypoints.cli.main`` where there is none), in its own session, its log in a file, every wait bounded.
3. The same ``/v1/completions`` request to each server (temperature 0, ``ignore_eos``, ``return_token_ids``,
   ``logprobs=1``): the door's generated token ids, texts and logprobs must equal the default loader's on the
   merged checkpoint.

The script run alone serves A (ours, the PEFT adapter) and B (default loader, merged) one after the other and exits
0 when they agree, 1 when they differ, 2 when the setup failed. Negative controls that must exit 1: ``--drop-lora``
and ``--a-extra-config '{"lora_scale": 0.5}'``. ``test_serve_e2e.py`` runs the whole set of servers.

This module imports only the standard library at top level: the tests import it from any interpreter and run the
build and the servers in the serving one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

FAMILY = "qwen2"  # not the in-process tests' Llama (tests/test_vllm_loader.py)
PROMPTS = (
    "The quick brown fox jumps over",
    "vLLM serves diffusion transformers with HSDP and",
    "Once upon a time, in a tiny model,",
)
MAX_TOKENS = 16
SERVED_NAME = "tiny-lm"
LOAD_FORMAT = "diffusion-hsdp"
_CORPUS = (
    "the quick brown fox jumps over the lazy dog. once upon a time there was a tiny model that learned "
    "to serve tokens. vllm serves diffusion transformers with hsdp, lora fusion and online quantization. "
    "weights stream from safetensors shards into a module; deltas B @ A are fused before sharding. "
)


class E2ESetupError(RuntimeError):
    """The proof could not be run (build, server start or request failed); not a token mismatch."""


# ---------------------------------------------------------------------------------------------------------
# Checkpoints (in the serving interpreter: `serve_lora_e2e.py build --out DIR`)
# ---------------------------------------------------------------------------------------------------------

def build_checkpoints(out: Path, *, seed: int = 0, lora_b_std: float = 0.1) -> dict:
    """Write ``base/``, ``lora/``, ``lora_kohya.safetensors``, ``merged/``, ``bad_lora.safetensors`` under ``out``
    and return (and write as ``reference.json``) transformers' greedy tokens of the base, the PEFT-wrapped and
    the merged model, the folders and files, and the key the bad adapter's refusal must name."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from vllm_diffusion_plugin.testing.bad_loras import write_bad_lora
    from vllm_diffusion_plugin.tiny.models import LLAMA_LORA_TARGETS, add_tiny_causal_lm_lora, build_tiny_causal_lm

    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in ("base", "lora", "merged")}
    paths |= {"lora_kohya": out / "lora_kohya.safetensors", "bad_lora": out / "bad_lora.safetensors"}

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([_CORPUS] * 4, trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", model_max_length=512)

    model = build_tiny_causal_lm(
        family=FAMILY, seed=seed, vocab_size=len(tokenizer), max_position_embeddings=512, initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id)
    model.save_pretrained(paths["base"], max_shard_size="500KB")
    tokenizer.save_pretrained(paths["base"])

    prompt_ids = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in PROMPTS]
    reference: dict = {"prompt_token_ids": prompt_ids, "base": _greedy(model, prompt_ids)}

    peft_model = add_tiny_causal_lm_lora(model, seed=seed + 1, b_std=lora_b_std)
    n_b = sum("lora_B" in name for name, _ in peft_model.named_parameters())
    layers = model.config.num_hidden_layers
    if n_b != layers * len(LLAMA_LORA_TARGETS):
        raise E2ESetupError(f"expected {layers * len(LLAMA_LORA_TARGETS)} lora_B tensors, peft made {n_b}")
    peft_model.save_pretrained(paths["lora"])
    reference["peft_unmerged"] = _greedy(peft_model, prompt_ids)
    _write_kohya(paths["lora"], paths["lora_kohya"])
    reference["bad_key"] = write_bad_lora("shape", paths["lora"] / "adapter_model.safetensors", paths["bad_lora"])

    merged = peft_model.merge_and_unload().eval()
    merged.save_pretrained(paths["merged"], max_shard_size="500KB")
    tokenizer.save_pretrained(paths["merged"])
    reference["merged"] = _greedy(merged, prompt_ids)
    reference["paths"] = {k: str(v) for k, v in paths.items()}
    (out / "reference.json").write_text(json.dumps(reference, indent=1))
    return reference


def _write_kohya(peft_dir: Path, path: Path) -> None:
    """The PEFT adapter in kohya naming: ``lora_unet_<module, dots as underscores>.lora_down.weight`` (A),
    ``.lora_up.weight`` (B) and ``.alpha`` (the adapter's ``lora_alpha``: the same ``alpha / r`` scale)."""
    import torch
    from safetensors.torch import load_file, save_file

    alpha = json.loads((peft_dir / "adapter_config.json").read_text())["lora_alpha"]
    tensors = {}
    for key, value in load_file(str(peft_dir / "adapter_model.safetensors")).items():
        module, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
        name = "lora_unet_" + module.replace(".", "_")
        tensors[f"{name}.lora_{'down' if kind == 'A.weight' else 'up'}.weight"] = value
        tensors[f"{name}.alpha"] = torch.tensor(float(alpha))
    save_file(tensors, str(path))


def _greedy(model, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Greedy continuation, MAX_TOKENS per prompt, EOS ignored."""
    import torch

    outputs = []
    with torch.no_grad():
        for ids in prompt_ids:
            seq = torch.tensor([ids])
            for _ in range(MAX_TOKENS):
                token = model(input_ids=seq).logits[0, -1].argmax().reshape(1, 1)
                seq = torch.cat([seq, token], dim=1)
            outputs.append(seq[0, len(ids):].tolist())
    return outputs


def build(python: str, workdir: Path) -> dict:
    """``build_checkpoints`` run in the serving interpreter ``python``; checks that the comparison can prove
    something (the LoRA changes transformers' greedy tokens; peft's merged and unmerged models agree)."""
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([python, str(Path(__file__).resolve()), "build", "--out", str(workdir)],
                          capture_output=True, text=True, timeout=600, env=server_env(plugin=False))
    if proc.returncode != 0:
        raise E2ESetupError(f"build failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    reference = json.loads((workdir / "reference.json").read_text())
    if reference["base"] == reference["merged"]:
        raise E2ESetupError("the LoRA does not change transformers' greedy tokens: a comparison would prove nothing")
    if reference["peft_unmerged"] != reference["merged"]:
        raise E2ESetupError(f"peft's unmerged and merged models disagree: {reference['peft_unmerged']} vs "
                            f"{reference['merged']}")
    return reference


# ---------------------------------------------------------------------------------------------------------
# Servers (stdlib only)
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Completion:
    """What one server answered to the request of every prompt, and how long it took to get there."""

    server: str
    log: str
    start_s: float
    """Launch to a healthy ``/health``."""
    request_s: float
    prompt_token_ids: tuple[tuple[int, ...], ...]
    token_ids: tuple[tuple[int, ...], ...]
    token_logprobs: tuple[tuple[float, ...], ...]
    texts: tuple[str, ...]

    def answers(self) -> tuple:
        """What must be equal between two servers: every token id, text and logprob."""
        return self.prompt_token_ids, self.token_ids, self.texts, self.token_logprobs


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(*, plugin: bool, tensor_parallel: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "VLLM_DIFFUSION_PLUGIN": "1" if plugin else "0",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB; CPU build only
        "PYTHONUNBUFFERED": "1",
    })
    if tensor_parallel > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(tensor_parallel)
    env.pop("VLLM_PLUGINS", None)  # all general plugins (ours is a no-op when disabled)
    return env


def cpu_bind(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers: this process's CPUs in ``ranks`` groups. vLLM's CPU
    build binds each worker to a NUMA node by default and refuses more workers than nodes ("Not enough allowed
    NUMA nodes to bind threads of 2 local CPUWorkers"); ignored by GPU builds."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        raise E2ESetupError(f"{ranks} tensor-parallel CPU workers need {ranks} CPUs; this process has {len(cpus)}")
    size = len(cpus) // ranks
    return "|".join(",".join(map(str, cpus[i * size:(i + 1) * size])) for i in range(ranks))


def vllm_command(python: str) -> list[str]:
    """``vllm`` as a user runs it: the console script beside the interpreter, else its module."""
    script = Path(python).with_name("vllm")
    return [str(script)] if script.is_file() else [python, "-m", "vllm.entrypoints.cli.main"]


class Server:
    """One ``vllm serve`` process group: ``start``, ``wait_healthy``, ``complete``, ``stop`` (always, in ``with``).

    ``load_format`` None is vLLM's default loader (plugin disabled); ``extra_config`` is the door's
    ``--model-loader-extra-config``."""

    def __init__(self, name: str, python: str, model: Path, logdir: Path, *, load_format: str | None = LOAD_FORMAT,
                 extra_config: dict | None = None, tensor_parallel: int = 1, extra_args: tuple[str, ...] = ()):
        self.name, self.port = name, free_port()
        self.log = logdir / f"{name}.log"
        self.command = [*vllm_command(python), "serve", str(model), "--served-model-name", SERVED_NAME,
                        "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                        "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0",
                        "--tensor-parallel-size", str(tensor_parallel), *extra_args]
        if load_format:
            self.command += ["--load-format", load_format]
        if extra_config is not None:
            self.command += ["--model-loader-extra-config", json.dumps(extra_config)]
        self.env = server_env(plugin=load_format == LOAD_FORMAT, tensor_parallel=tensor_parallel)
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> Server:
        print(f"[{self.name}] starting: {' '.join(self.command)}", flush=True)
        self.started = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait_healthy(self, timeout_s: float = 900.0) -> float:
        """Seconds from launch to a healthy ``/health``; ``E2ESetupError`` (with the log's tail) when the server
        exits or the time runs out first."""
        while True:
            if self.proc.poll() is not None:
                raise E2ESetupError(f"[{self.name}] server exited with status {self.proc.returncode} before "
                                    f"becoming healthy; log {self.log}:\n{self.log_tail()}")
            if time.monotonic() - self.started > timeout_s:
                raise E2ESetupError(f"[{self.name}] server not healthy after {timeout_s:.0f} s; log {self.log}:\n"
                                    f"{self.log_tail()}")
            try:
                if _http_json(f"http://127.0.0.1:{self.port}/health", timeout=5)[0] == 200:
                    return time.monotonic() - self.started
            except OSError:  # not listening yet (URLError, ConnectionError and timeouts are OSErrors)
                pass
            time.sleep(1.0)

    def exit_status(self, timeout_s: float) -> int | None:
        """The server's exit status once it has exited within ``timeout_s``, else None."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def complete(self, *, health_timeout_s: float = 900.0, request_timeout_s: float = 300.0) -> Completion:
        """Wait until healthy, then send every prompt in one ``/v1/completions`` request."""
        start_s = self.wait_healthy(health_timeout_s)
        print(f"[{self.name}] healthy after {start_s:.1f} s", flush=True)
        payload = {"model": SERVED_NAME, "prompt": list(PROMPTS), "max_tokens": MAX_TOKENS, "temperature": 0.0,
                   "ignore_eos": True, "return_token_ids": True, "logprobs": 1, "seed": 0}
        t0 = time.monotonic()
        status, body = _http_json(f"http://127.0.0.1:{self.port}/v1/completions", payload, timeout=request_timeout_s)
        if status != 200 or not isinstance(body, dict):
            raise E2ESetupError(f"[{self.name}] /v1/completions answered {status}: {body}\nlog {self.log}:\n"
                                f"{self.log_tail()}")
        choices = sorted(body["choices"], key=lambda c: c["index"])
        if len(choices) != len(PROMPTS) or any(c.get("token_ids") is None for c in choices):
            raise E2ESetupError(f"[{self.name}] expected {len(PROMPTS)} choices with token_ids, got {body}")
        return Completion(
            server=self.name, log=str(self.log), start_s=start_s, request_s=time.monotonic() - t0,
            prompt_token_ids=tuple(tuple(c.get("prompt_token_ids") or ()) for c in choices),
            token_ids=tuple(tuple(c["token_ids"]) for c in choices),
            token_logprobs=tuple(tuple((c.get("logprobs") or {}).get("token_logprobs") or ()) for c in choices),
            texts=tuple(c["text"] for c in choices))

    def members(self) -> list[int]:
        """Live processes of the server's session (every process it started, unless one left the session)."""
        return session_members(self.proc.pid)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL whatever is left after ``grace_s``."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self.proc.poll() is None or self.members()):
            time.sleep(0.5)
        for pid in self.members():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        print(f"[{self.name}] stopped", flush=True)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError as e:
            return f"(no log: {e})"


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid`` (Linux /proc; empty elsewhere)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def _http_json(url: str, payload: dict | None = None, *, timeout: float) -> tuple[int, dict | str]:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, body = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    try:
        return status, json.loads(body) if body else {}
    except json.JSONDecodeError:
        return status, body


def serve(name: str, python: str, model: Path, logdir: Path, **kwargs) -> Completion:
    """One server's answers: started, asked, stopped."""
    with Server(name, python, model, logdir, **kwargs) as server:
        return server.complete()


def compare(a: Completion, b: Completion) -> list[str]:
    """Each prompt where ``a`` and ``b`` differ: its tokens, texts and the largest logprob difference."""
    lines = []
    for i, prompt in enumerate(PROMPTS):
        if tuple(x[i] for x in a.answers()) != tuple(x[i] for x in b.answers()):
            diff = max((abs(x - y) for x, y in zip(a.token_logprobs[i], b.token_logprobs[i])), default=float("nan"))
            lines.append(f"prompt {i} {prompt!r}: {a.server} {list(a.token_ids[i])} {a.texts[i]!r}, {b.server} "
                         f"{list(b.token_ids[i])} {b.texts[i]!r}, max |logprob diff| {diff:.3g}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["build"]:
        parser = argparse.ArgumentParser(prog="serve_lora_e2e.py build")
        parser.add_argument("--out", type=Path, required=True)
        build_checkpoints(parser.parse_args(argv[1:]).out)
        return 0

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter with a serving vLLM build, this plugin, transformers and peft")
    parser.add_argument("--workdir", type=Path, help="where to write checkpoints and logs (default: a tmp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the workdir (checkpoints, server logs)")
    parser.add_argument("--drop-lora", action="store_true",
                        help="negative control: serve A without the LoRA; the run must then FAIL (exit 1)")
    parser.add_argument("--a-extra-config", type=json.loads, default={}, metavar="JSON",
                        help='keys added to server A\'s --model-loader-extra-config, e.g. \'{"lora_scale": 0.5}\' '
                             "(a negative control: must FAIL)")
    parser.add_argument("--json", action="store_true", help="print both servers' answers as JSON at the end")
    parser.add_argument("server_args", nargs="*", help="extra args for both servers (after `--`)")
    args = parser.parse_args(argv)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-diffusion-e2e-"))
    try:
        reference = build(args.python, workdir)
        paths = {k: Path(v) for k, v in reference["paths"].items()}
        extra = ({} if args.drop_lora else {"lora_path": str(paths["lora"])}) | args.a_extra_config
        a = serve("ours-peft", args.python, paths["base"], workdir, extra_config=extra,
                  extra_args=tuple(args.server_args))
        b = serve("default-merged", args.python, paths["merged"], workdir, load_format=None,
                  extra_args=tuple(args.server_args))
    except (E2ESetupError, subprocess.TimeoutExpired) as e:
        print(f"SETUP FAILED: {e}\n(workdir kept: {workdir})", file=sys.stderr)
        return 2
    differences = compare(a, b)
    print("\n".join(differences) or f"PASS: {a.server} answers every prompt as {b.server} (tokens, texts, logprobs)")
    if args.json:
        print(json.dumps({"a": asdict(a), "b": asdict(b)}))
    if args.keep:
        print(f"(workdir kept: {workdir})")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
