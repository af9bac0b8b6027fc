#!/usr/bin/env python3
"""Real-server proof: a LoRA fused at load by ``--load-format diffusion-hsdp`` serves the same tokens as
the peft-merged checkpoint served by vLLM's default loader.

    python tests/e2e/serve_lora_e2e.py --python /work/venv-cpu-serve/bin/python [--keep] [--json]

Steps (everything local, loopback only, every wait bounded):

1. ``build`` (run in the serving interpreter, which needs torch, transformers, peft, tokenizers): a tiny
   ``LlamaForCausalLM`` (hidden 128, head_dim 64, GQA 2q/1kv heads, 2 layers) with a byte-level BPE
   tokenizer trained here, saved sharded by transformers; a peft LoRA (r=8 on q/k/v/o/gate/up/down, random
   non-zero B) saved by peft; the checkpoint merged by peft's ``merge_and_unload()``; and transformers'
   own greedy continuations of the prompts for the base, the LoRA-wrapped and the merged model.
2. Server A: ``VLLM_DIFFUSION_PLUGIN=1 python -m vllm.entrypoints.openai.api_server --model BASE
   --load-format diffusion-hsdp --model-loader-extra-config '{"lora_path": LORA}'``.
3. Server B: the merged checkpoint, default loader, plugin disabled.
4. The same ``/v1/completions`` request to each (temperature 0, ``ignore_eos``, ``return_token_ids``,
   ``logprobs=1``); the generated token ids must be equal. The build first checks that the LoRA changes
   transformers' greedy tokens, so a loader that drops or mis-scales the LoRA makes A differ from B.

Servers run one after the other (each in its own process group, killed in ``finally``). Exit status: 0 when
A's tokens equal B's, 1 when they differ, 2 when the setup failed (build, server start, request).
Negative controls that must exit 1: ``--drop-lora`` (A serves the base, as a loader that ignores
``lora_path`` would) and ``--a-extra-config '{"lora_scale": 0.5}'`` (A fuses the LoRA at half weight, as a
loader that ignores PEFT's ``lora_alpha / r`` = 2 would).

This module imports only the standard library at top level: the pytest wrapper imports it from the test
environment and runs the build and the servers in the serving interpreter.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS = (
    "The quick brown fox jumps over",
    "vLLM serves diffusion transformers with HSDP and",
    "Once upon a time, in a tiny model,",
)
MAX_TOKENS = 16
SERVED_NAME = "tiny-llama"
LOAD_FORMAT = "diffusion-hsdp"
_CORPUS = (
    "the quick brown fox jumps over the lazy dog. once upon a time there was a tiny model that learned "
    "to serve tokens. vllm serves diffusion transformers with hsdp, lora fusion and online quantization. "
    "weights stream from safetensors shards into a module; deltas B @ A are fused before sharding. "
)


class E2ESetupError(RuntimeError):
    """The proof could not be run (build, server start or request failed); not a token mismatch."""


# ---------------------------------------------------------------------------------------------------------
# Step 1: checkpoints (runs in the serving interpreter: `serve_lora_e2e.py build --out DIR`)
# ---------------------------------------------------------------------------------------------------------

def build_checkpoints(out: Path, *, seed: int = 0, lora_b_std: float = 0.1) -> dict:
    """Write ``base/``, ``lora/``, ``merged/`` under ``out`` and return the transformers reference.

    The reference holds, per prompt, the prompt token ids and the greedy continuations (MAX_TOKENS, EOS
    ignored) of the base, the peft-wrapped (LoRA applied on the fly) and the merged model, plus the smallest
    top-1/top-2 logit margin met on the merged model's greedy path (how close a tie came).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from vllm_diffusion_plugin.tiny.models import LLAMA_LORA_TARGETS, add_tiny_llama_lora, build_tiny_llama

    out.mkdir(parents=True, exist_ok=True)
    dirs = {name: out / name for name in ("base", "lora", "merged")}

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([_CORPUS] * 4, trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", model_max_length=512)

    model = build_tiny_llama(
        seed=seed, vocab_size=len(tokenizer), max_position_embeddings=512, initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id)
    model.save_pretrained(dirs["base"], max_shard_size="500KB")
    tokenizer.save_pretrained(dirs["base"])

    prompt_ids = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in PROMPTS]
    reference: dict = {"prompt_token_ids": prompt_ids, "vocab_size": len(tokenizer)}
    reference["base"], _ = _greedy(model, prompt_ids)

    peft_model = add_tiny_llama_lora(model, seed=seed + 1, b_std=lora_b_std)
    n_b = sum("lora_B" in name for name, _ in peft_model.named_parameters())
    if n_b != 2 * len(LLAMA_LORA_TARGETS):
        raise E2ESetupError(f"expected 14 lora_B tensors (2 layers x 7 modules), peft made {n_b}")
    peft_model.save_pretrained(dirs["lora"])
    reference["peft_unmerged"], _ = _greedy(peft_model, prompt_ids)

    merged = peft_model.merge_and_unload().eval()
    merged.save_pretrained(dirs["merged"], max_shard_size="500KB")
    tokenizer.save_pretrained(dirs["merged"])
    reference["merged"], reference["merged_min_margin"] = _greedy(merged, prompt_ids)
    reference["dirs"] = {k: str(v) for k, v in dirs.items()}
    reference["files"] = {k: sorted(p.name for p in v.iterdir()) for k, v in dirs.items()}
    (out / "reference.json").write_text(json.dumps(reference, indent=1))
    return reference


def _greedy(model, prompt_ids: list[list[int]]) -> tuple[list[list[int]], float]:
    """Greedy continuation, MAX_TOKENS per prompt, EOS ignored; also the smallest top-1/top-2 margin."""
    import torch

    outputs, min_margin = [], float("inf")
    with torch.no_grad():
        for ids in prompt_ids:
            seq = torch.tensor([ids])
            new: list[int] = []
            for _ in range(MAX_TOKENS):
                logits = model(input_ids=seq).logits[0, -1].float()
                top2 = torch.topk(logits, 2)
                min_margin = min(min_margin, float(top2.values[0] - top2.values[1]))
                token = int(top2.indices[0])
                new.append(token)
                seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
            outputs.append(new)
    return outputs, min_margin


# ---------------------------------------------------------------------------------------------------------
# Steps 2-4: servers (stdlib only)
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ServerRun:
    """What one server produced: generated token ids and logprobs per prompt, and how long things took."""

    name: str
    command: tuple[str, ...]
    log: str
    start_s: float
    """Launch to healthy ``/health``."""
    request_s: float
    prompt_token_ids: tuple[tuple[int, ...], ...]
    token_ids: tuple[tuple[int, ...], ...]
    token_logprobs: tuple[tuple[float, ...], ...]
    texts: tuple[str, ...]


@dataclass(frozen=True)
class E2EResult:
    """The outcome of one proof run; ``passed`` means A's generated token ids equal B's."""

    workdir: str
    build_s: float
    total_s: float
    reference: dict
    server_a: ServerRun
    server_b: ServerRun
    lora_changes_tokens: bool
    """transformers' greedy tokens of the base and the merged model differ (else the proof proves nothing)."""
    max_abs_logprob_diff: float
    """Over the generated tokens where A and B agree."""
    a_equals_transformers_merged: bool
    """Informational: vLLM CPU kernels against transformers' eager forward."""
    passed: bool = field(default=False)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(*, plugin: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "VLLM_DIFFUSION_PLUGIN": "1" if plugin else "0",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB; CPU build only
        "PYTHONUNBUFFERED": "1",
    })
    env.pop("VLLM_PLUGINS", None)  # all general plugins (ours is a no-op when disabled)
    return env


def server_command(python: str, *, model: Path, port: int, load_format: str | None,
                   extra_config: dict | None, extra_args: list[str]) -> list[str]:
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager",
           "--seed", "0"]
    if load_format:
        cmd += ["--load-format", load_format]
    if extra_config is not None:
        cmd += ["--model-loader-extra-config", json.dumps(extra_config)]
    return cmd + list(extra_args)


def _http_json(url: str, payload: dict | None = None, *, timeout: float) -> tuple[int, dict | str]:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    try:
        return status, json.loads(body) if body else {}
    except json.JSONDecodeError:
        return status, body


def _log_tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"


def _pgid_members(pgid: int) -> list[int]:
    """Live processes of a process group (Linux /proc; empty elsewhere)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def stop_server(proc: subprocess.Popen, *, grace_s: float = 30.0) -> None:
    """SIGTERM the server's whole process group, then SIGKILL whatever is left after ``grace_s``."""
    pgid = proc.pid  # started with start_new_session=True: the group id is the leader's pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _pgid_members(pgid):
            return
        time.sleep(0.5)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def serve_and_complete(name: str, cmd: list[str], *, env: dict[str, str], port: int, log: Path,
                       health_timeout_s: float, request_timeout_s: float) -> ServerRun:
    """Start one server, wait for ``/health``, send the completion request, stop the server (always)."""
    base = f"http://127.0.0.1:{port}"
    print(f"[{name}] starting: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = t0 + health_timeout_s
        while True:
            if proc.poll() is not None:
                raise E2ESetupError(f"[{name}] server exited with status {proc.returncode} before "
                                    f"becoming healthy; log {log}:\n{_log_tail(log)}")
            if time.monotonic() > deadline:
                raise E2ESetupError(f"[{name}] server not healthy after {health_timeout_s:.0f} s; "
                                    f"log {log}:\n{_log_tail(log)}")
            try:
                status, _ = _http_json(f"{base}/health", timeout=5)
                if status == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        start_s = time.monotonic() - t0
        print(f"[{name}] healthy after {start_s:.1f} s", flush=True)

        payload = {"model": SERVED_NAME, "prompt": list(PROMPTS), "max_tokens": MAX_TOKENS,
                   "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "logprobs": 1,
                   "seed": 0}
        t1 = time.monotonic()
        status, body = _http_json(f"{base}/v1/completions", payload, timeout=request_timeout_s)
        request_s = time.monotonic() - t1
        if status != 200 or not isinstance(body, dict):
            raise E2ESetupError(f"[{name}] /v1/completions answered {status}: {body}\nlog {log}:\n"
                                f"{_log_tail(log)}")
        choices = sorted(body["choices"], key=lambda c: c["index"])
        if len(choices) != len(PROMPTS) or any(c.get("token_ids") is None for c in choices):
            raise E2ESetupError(f"[{name}] expected {len(PROMPTS)} choices with token_ids, got {body}")
        return ServerRun(
            name=name, command=tuple(cmd), log=str(log), start_s=start_s, request_s=request_s,
            prompt_token_ids=tuple(tuple(c.get("prompt_token_ids") or ()) for c in choices),
            token_ids=tuple(tuple(c["token_ids"]) for c in choices),
            token_logprobs=tuple(tuple((c.get("logprobs") or {}).get("token_logprobs") or ())
                                 for c in choices),
            texts=tuple(c["text"] for c in choices),
        )
    finally:
        stop_server(proc)
        print(f"[{name}] stopped", flush=True)


def run_e2e(python: str, workdir: Path, *, drop_lora: bool = False, a_extra_config: dict | None = None,
            health_timeout_s: float = 900.0, request_timeout_s: float = 300.0,
            extra_server_args: list[str] | None = None) -> E2EResult:
    """Build the checkpoints with ``python``, serve A (plugin + LoRA) then B (merged, default), compare.

    ``a_extra_config`` adds keys to A's ``--model-loader-extra-config`` (e.g. ``{"lora_scale": 0.5}``, a
    negative control: the fused LoRA then has half its weight and the tokens must differ).
    """
    t_start = time.monotonic()
    extra_server_args = list(extra_server_args or [])
    workdir.mkdir(parents=True, exist_ok=True)

    print(f"[build] writing tiny Llama, peft LoRA and merged checkpoint under {workdir}", flush=True)
    t0 = time.monotonic()
    build = subprocess.run([python, str(Path(__file__).resolve()), "build", "--out", str(workdir)],
                           capture_output=True, text=True, timeout=600, env=server_env(plugin=False))
    build_s = time.monotonic() - t0
    if build.returncode != 0:
        raise E2ESetupError(f"build failed ({build.returncode}):\n{build.stdout[-3000:]}\n"
                            f"{build.stderr[-6000:]}")
    reference = json.loads((workdir / "reference.json").read_text())
    dirs = {k: Path(v) for k, v in reference["dirs"].items()}
    lora_changes_tokens = reference["base"] != reference["merged"]
    print(f"[build] done in {build_s:.1f} s; LoRA changes transformers' greedy tokens: {lora_changes_tokens};"
          f" smallest top-1/top-2 logit margin on the merged greedy path: "
          f"{reference['merged_min_margin']:.4f}", flush=True)
    if reference["peft_unmerged"] != reference["merged"]:
        raise E2ESetupError("peft's unmerged and merged models disagree on greedy tokens: "
                            f"{reference['peft_unmerged']} vs {reference['merged']}")

    extra = ({} if drop_lora else {"lora_path": str(dirs["lora"])}) | dict(a_extra_config or {})
    port = free_port()
    run_a = serve_and_complete(
        "A plugin+LoRA", server_command(python, model=dirs["base"], port=port, load_format=LOAD_FORMAT,
                                        extra_config=extra, extra_args=extra_server_args),
        env=server_env(plugin=True), port=port, log=workdir / "server_a.log",
        health_timeout_s=health_timeout_s, request_timeout_s=request_timeout_s)
    port = free_port()
    run_b = serve_and_complete(
        "B merged+default", server_command(python, model=dirs["merged"], port=port, load_format=None,
                                           extra_config=None, extra_args=extra_server_args),
        env=server_env(plugin=False), port=port, log=workdir / "server_b.log",
        health_timeout_s=health_timeout_s, request_timeout_s=request_timeout_s)

    diffs = [abs(a - b) for la, lb, ta, tb in zip(run_a.token_logprobs, run_b.token_logprobs,
                                                  run_a.token_ids, run_b.token_ids)
             for a, b, x, y in zip(la, lb, ta, tb) if x == y and a is not None and b is not None]
    passed = run_a.token_ids == run_b.token_ids
    return E2EResult(
        workdir=str(workdir), build_s=build_s, total_s=time.monotonic() - t_start, reference=reference,
        server_a=run_a, server_b=run_b, lora_changes_tokens=lora_changes_tokens,
        max_abs_logprob_diff=max(diffs, default=float("nan")),
        a_equals_transformers_merged=[list(t) for t in run_a.token_ids] == reference["merged"],
        passed=passed,
    )


def report(result: E2EResult) -> str:
    ref = result.reference
    lines = [f"workdir: {result.workdir}"]
    for i, prompt in enumerate(PROMPTS):
        a, b = result.server_a.token_ids[i], result.server_b.token_ids[i]
        lines += [f"prompt {i}: {prompt!r} -> ids {list(result.server_a.prompt_token_ids[i])}",
                  f"  A (diffusion-hsdp + LoRA): {list(a)}  {result.server_a.texts[i]!r}",
                  f"  B (default, merged):       {list(b)}  {result.server_b.texts[i]!r}",
                  f"  transformers merged:       {ref['merged'][i]}",
                  f"  transformers base:         {ref['base'][i]}",
                  f"  A == B: {a == b}"]
    lines += [
        f"LoRA changes transformers' greedy tokens: {result.lora_changes_tokens}",
        f"max |logprob A - logprob B| over agreeing tokens: {result.max_abs_logprob_diff:.3g}",
        f"A equals transformers' merged greedy tokens (informational): {result.a_equals_transformers_merged}",
        f"timings: build {result.build_s:.1f} s, server A start {result.server_a.start_s:.1f} s "
        f"(request {result.server_a.request_s:.2f} s), server B start {result.server_b.start_s:.1f} s "
        f"(request {result.server_b.request_s:.2f} s), total {result.total_s:.1f} s",
        "RESULT: " + ("PASS: A's tokens equal B's" if result.passed else "FAIL: A's tokens differ from B's"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["build"]:
        parser = argparse.ArgumentParser(prog="serve_lora_e2e.py build")
        parser.add_argument("--out", type=Path, required=True)
        parser.add_argument("--seed", type=int, default=0)
        args = parser.parse_args(argv[1:])
        build_checkpoints(args.out, seed=args.seed)
        return 0

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter with a serving vLLM build, this plugin, transformers and peft")
    parser.add_argument("--workdir", type=Path, help="where to write checkpoints and logs (default: a tmp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the workdir (checkpoints, server logs)")
    parser.add_argument("--drop-lora", action="store_true",
                        help="negative control: serve A without the LoRA; the run must then FAIL (exit 1)")
    parser.add_argument("--a-extra-config", type=json.loads, default=None, metavar="JSON",
                        help='keys added to server A\'s --model-loader-extra-config, e.g. \'{"lora_scale": 0.5}\' '
                             "(a negative control: must FAIL)")
    parser.add_argument("--health-timeout", type=float, default=900.0, help="seconds per server start")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object at the end")
    parser.add_argument("server_args", nargs="*", help="extra args for both servers (after `--`)")
    args = parser.parse_args(argv)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-diffusion-e2e-"))
    try:
        result = run_e2e(args.python, workdir, drop_lora=args.drop_lora,
                         a_extra_config=args.a_extra_config, health_timeout_s=args.health_timeout,
                         extra_server_args=args.server_args)
    except (E2ESetupError, subprocess.TimeoutExpired) as e:
        print(f"SETUP FAILED: {e}", file=sys.stderr)
        print(f"(workdir kept: {workdir})", file=sys.stderr)
        return 2
    print(report(result))
    if args.json:
        print(json.dumps(dataclasses.asdict(result)))
    if args.keep:
        print(f"(workdir kept: {workdir})")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    if not result.lora_changes_tokens:
        print("SETUP FAILED: the LoRA does not change the greedy tokens; the comparison would prove nothing",
              file=sys.stderr)
        return 2
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
