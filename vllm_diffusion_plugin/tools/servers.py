"""Real ``vllm serve DIR --omni`` servers, one at a time: start on 127.0.0.1 in their own process group, wait
for ``/health`` within a bound, send requests, stop the whole group (also when the caller is interrupted), and
read our load path's report lines from the log.

The serving proof (``tests/serve``), ``benchmarks/bench_serve_startup.py`` and ``vllm-diffusion demo --serve``
all run servers through this module. Needs the ``[omni]`` environment (vLLM 0.30 + vllm-omni 0.30); on a
CPU-only host the servers use this package's CPU platform for vllm-omni (``VLLM_DIFFUSION_OMNI_CPU=1``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vllm_diffusion_plugin.engine.report import REPORT_PREFIX
from vllm_diffusion_plugin.tools.process_stats import GroupSampler, ProcessStats  # noqa: F401

VIDEO_FORM = {"prompt": "a red cat walks on the beach", "width": "32", "height": "32", "num_frames": "5",
              "num_inference_steps": "4", "guidance_scale": "1.0", "guidance_scale_2": "1.0",
              "boundary_ratio": "0.875", "seed": "1234", "fps": "8"}
"""The tiny Wan2.2 pipeline's video request: fixed seed, 4 steps so that both experts run (flow shift 5 puts
timesteps 1000, 937 above the 0.875 boundary -> ``transformer``; 833, 625 below -> ``transformer_2``)."""


LOAD_MARKS = {"loaded": "Model loading took"}
"""vllm-omni's diffusion model runner writes this line when a worker's ``load_model`` returns (our door's too)."""


class ServerError(RuntimeError):
    """A server did not start, did not stop, or a request failed (not a wrong answer). Raised by :func:`serve`,
    it carries the ``ServerRun`` so far as ``run`` (its log and sampled processes)."""

    run: "ServerRun | None" = None


@dataclass(frozen=True)
class ServerSpec:
    """One server: its name (log file ``<name>.log``), the folder it serves, whether our plugin is enabled
    (``VLLM_DIFFUSION_PLUGIN``), and the arguments after ``vllm serve DIR --omni``'s own."""

    name: str
    model: Path
    plugin: bool
    args: tuple[str, ...] = ()
    dtype: str = "float32"
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables for the server and its workers."""
    cgroup: Path | None = None
    """A cgroup folder (its ``cgroup.procs``) the server starts in, with every process it forks (a memory limit)."""
    shm: Path | None = None
    """A folder bound over /dev/shm for the server and every process it forks, in a private mount namespace (root,
    ``unshare``): what it leaves there is its own (other processes of the host leave segments in the real one)."""


@dataclass
class ServerRun:
    name: str
    command: list[str]
    log: Path
    pid: int = 0
    ready_s: float = float("nan")
    """Launch to the first healthy ``/health``."""
    request_s: list[float] = field(default_factory=list)
    answers: list[bytes] = field(default_factory=list)
    """The bytes each request returned (an mp4, a PNG, ...)."""
    processes: dict[int, ProcessStats] = field(default_factory=dict)
    """Every process of the server's process group seen by the sampler (``serve(sample_s=...)``), by PID."""

    @property
    def first_answer_s(self) -> float:
        """Launch to the first answered request (``ready_s`` + the first request's seconds)."""
        return self.ready_s + self.request_s[0] if self.request_s else float("nan")

    @property
    def workers(self) -> list[ProcessStats]:
        """The diffusion worker processes (vllm-omni titles them ``DiffusionWorker...``), by title."""
        return sorted((p for p in self.processes.values() if p.role == "worker"), key=lambda p: p.title)

    @property
    def videos(self) -> list[bytes]:
        return self.answers

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(*, plugin: bool, cpu: bool, extra: Mapping[str, str] = ()) -> dict[str, str]:
    """The server's environment: ours without any ``VLLM_DIFFUSION_*`` left over, offline, this checkout's package
    first on ``PYTHONPATH`` (every worker process imports it), the plugin on or off; on the CPU, our CPU platform
    with two CPU "devices" (the 2-rank servers work even on a 1-core runner)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION_")}
    package_root = str(Path(__file__).resolve().parents[2])
    env.update({"VLLM_DIFFUSION_PLUGIN": "1" if plugin else "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)})
    if cpu:
        env |= {"VLLM_DIFFUSION_OMNI_CPU": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_DIFFUSION_OMNI_CPU_DEVICES": "2"}
    env.update(dict(extra))
    return env


def server_command(spec: ServerSpec, port: int) -> list[str]:
    vllm = Path(sys.executable).with_name("vllm")
    cmd = [str(vllm), "serve", str(spec.model), "--omni", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", spec.dtype, "--enforce-eager", "--seed", "0"]
    if spec.shm is not None:  # exec all the way: the server keeps the process id (and group) Popen gave it
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"',
               str(spec.shm), *cmd]
    return cmd + list(spec.args)


def log_tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def stop(proc: subprocess.Popen, *, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``grace_s`` (it was started in its own session), and
    wait until no process of the group is left."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            proc.poll()
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                proc.poll()
                return
            proc.poll()
            time.sleep(0.5)
    raise ServerError(f"process group {proc.pid} still alive after SIGKILL")


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM ignored while the server is being stopped (a second Ctrl-C must not leave it running);
    restored afterwards. Only in the main thread, where Python handles signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def joining(cgroup: Path) -> Callable[[], None]:
    """A ``preexec_fn`` that puts the child into ``cgroup`` (writes its pid to ``cgroup.procs``) before it execs,
    so every process it forks is in the group too."""
    procs = str(cgroup / "cgroup.procs")
    return lambda: Path(procs).write_text(str(os.getpid()))


def launch(spec: ServerSpec, logdir: Path, *, cpu: bool) -> tuple[subprocess.Popen, ServerRun, int]:
    """Start the server in a new session (its own process group), stdout and stderr to ``logdir/<name>.log``."""
    port = free_port()
    logdir.mkdir(parents=True, exist_ok=True)
    run = ServerRun(name=spec.name, command=server_command(spec, port), log=logdir / f"{spec.name}.log")
    with open(run.log, "w") as log_file:
        join = None if spec.cgroup is None else joining(spec.cgroup)
        proc = subprocess.Popen(run.command, env=server_env(plugin=spec.plugin, cpu=cpu, extra=spec.env),
                                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=join)
    run.pid = proc.pid
    return proc, run, port


PORT_TAKEN = "Address already in use"


def port_taken(proc: subprocess.Popen, run: ServerRun) -> bool:
    """The server exited because another process took its port: :func:`free_port` closes the port before the server
    binds it, and another process (a test's rendezvous, another server) can take it in between -- seen with two
    test stages on one host. Such a server is started again on another port (:func:`serve`)."""
    return proc.poll() is not None and PORT_TAKEN in run.log.read_text(errors="replace")


ATTEMPTS = 3
"""Starts of one server at most, when it lost its port (:func:`port_taken`)."""


def _start_again(attempt: int, proc: subprocess.Popen, run: ServerRun) -> bool:
    """Whether start ``attempt`` of a server is to be made again: it lost its port and attempts are left. Its log
    is then kept beside the next one's (``<name>.port-taken-<attempt>.log``)."""
    if attempt >= ATTEMPTS or not port_taken(proc, run):
        return False
    run.log.rename(run.log.with_suffix(f".port-taken-{attempt}.log"))
    return True


def wait_healthy(proc: subprocess.Popen, run: ServerRun, port: int, *, timeout_s: float) -> float:
    """Seconds until ``/health`` answers; raises when the server exits first or ``timeout_s`` passes."""
    t0 = time.monotonic()
    while not healthy(port):
        if proc.poll() is not None:
            raise ServerError(f"[{run.name}] exited with status {proc.returncode} before becoming healthy; "
                              f"log {run.log}:\n{log_tail(run.log)}")
        if time.monotonic() - t0 > timeout_s:
            raise ServerError(f"[{run.name}] not healthy after {timeout_s:.0f} s; log {run.log}:\n{log_tail(run.log)}")
        time.sleep(0.5)
    return time.monotonic() - t0


Request = Callable[[int, float, Path], bytes]
"""``request(port, timeout_s, log) -> answer bytes``: :func:`request_video`, :func:`request_image`, ..."""


def serve(spec: ServerSpec, logdir: Path, *, request: Request | None = None, requests: int = 1, cpu: bool = True,
          ready_timeout_s: float = 600.0, request_timeout_s: float = 300.0, sample_s: float | None = None,
          marks: Mapping[str, str] = LOAD_MARKS, progress: Callable[[str], None] | None = None) -> ServerRun:
    """Start one server, wait until healthy, send ``request`` ``requests`` times (the Wan2.2 video request by
    default), stop it (always, also on Ctrl-C). ``sample_s``: sample every process of the server's group that
    often (:class:`GroupSampler`; ``run.processes``), with the figures at ``marks`` (default: each worker's
    end of load, vllm-omni's "Model loading took" line, before its warm-up run). ``progress``: called with a line
    when ready and when each request is answered."""
    request = request or request_video
    for attempt in range(1, ATTEMPTS + 1):
        proc, run, port = launch(spec, logdir, cpu=cpu)
        t0 = time.monotonic()
        sampler = GroupSampler(proc.pid, interval_s=sample_s, log=run.log, marks=dict(marks)) if sample_s else None
        if sampler:
            sampler.start()
        try:
            wait_healthy(proc, run, port, timeout_s=ready_timeout_s)
            run.ready_s = time.monotonic() - t0
            if progress:
                progress(f"[{spec.name}] ready after {run.ready_s:.1f} s")
            for i in range(requests):
                t1 = time.monotonic()
                run.answers.append(request(port, request_timeout_s, run.log))
                run.request_s.append(time.monotonic() - t1)
                if progress:
                    progress(f"[{spec.name}] request {i + 1} answered after {run.request_s[-1]:.1f} s "
                             f"({time.monotonic() - t0:.1f} s after launch)")
            return run
        except ServerError as exc:
            if _start_again(attempt, proc, run):
                continue
            exc.run = run  # what was measured before the failure (log, sampled processes)
            raise
        finally:
            with signals_held():
                if sampler:
                    run.processes = sampler.finish()  # while the processes are still alive: their last figures
                stop(proc)
    raise AssertionError("unreachable")


def refused_start(spec: ServerSpec, logdir: Path, *, cpu: bool = True,
                  timeout_s: float = 300.0) -> tuple[int, str, float]:
    """Start a server that must refuse to start: ``(exit status, log, seconds)``; raises if it became healthy
    or was still running after ``timeout_s``. A server that lost its port (:func:`port_taken`) is started again."""
    for attempt in range(1, ATTEMPTS + 1):
        proc, run, port = launch(spec, logdir, cpu=cpu)
        t0 = time.monotonic()
        try:
            while proc.poll() is None:
                if healthy(port):
                    raise ServerError(f"[{spec.name}] became healthy; it should have refused to start. Log {run.log}")
                if time.monotonic() - t0 > timeout_s:
                    raise ServerError(f"[{spec.name}] neither refused nor started within {timeout_s:.0f} s; "
                                      f"log {run.log}:\n{log_tail(run.log)}")
                time.sleep(1.0)
            if _start_again(attempt, proc, run):
                continue
            return proc.returncode, run.log_text(), time.monotonic() - t0
        finally:
            with signals_held():
                stop(proc)
    raise AssertionError("unreachable")


def _post(port: int, path: str, body: bytes, content_type: str, *, timeout_s: float, log: Path) -> tuple[bytes, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST",
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        raise ServerError(f"{path} answered {e.code}: {e.read()[:2000]!r}\n{log_tail(log)}") from e
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise ServerError(f"{path} failed: {e}\n{log_tail(log)}") from e


def request_video(port: int, timeout_s: float, log: Path, *, form: Mapping[str, str] = VIDEO_FORM) -> bytes:
    """``POST /v1/videos/sync`` (multipart form) -> the mp4 bytes."""
    boundary = uuid.uuid4().hex
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
                    for k, v in form.items()) + f"--{boundary}--\r\n".encode()
    data, content_type = _post(port, "/v1/videos/sync", body, f"multipart/form-data; boundary={boundary}",
                               timeout_s=timeout_s, log=log)
    if "video/mp4" not in content_type or len(data) < 100:
        raise ServerError(f"/v1/videos/sync returned {content_type!r}, {len(data)} bytes")
    return data


def request_image(port: int, timeout_s: float, log: Path, *, body: Mapping[str, object]) -> bytes:
    """``POST /v1/images/generations`` (JSON ``body``: prompt, size "WxH", n, num_inference_steps, seed, ...)
    -> the first image's bytes (``data[0].b64_json`` decoded)."""
    data, _ = _post(port, "/v1/images/generations", json.dumps(dict(body)).encode(), "application/json",
                    timeout_s=timeout_s, log=log)
    try:
        return base64.b64decode(json.loads(data)["data"][0]["b64_json"])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ServerError(f"/v1/images/generations returned no image ({e}): {data[:500]!r}") from e


# ---- our load path's report lines -------------------------------------------------------------------------
_FIELD = re.compile(r"(\w+)=(\S+)")


def load_reports(log_text: str) -> list[dict[str, str]]:
    """Every ``diffusion-hsdp load report: key=value ...`` line of a server log, as a dict per line (the line is
    written by ``vllm_diffusion_plugin.engine.report.report_line``)."""
    reports = []
    for line in log_text.splitlines():
        _, sep, rest = line.partition(REPORT_PREFIX)
        if sep:
            reports.append(dict(_FIELD.findall(rest)))
    return reports


_OMNI_LOAD = re.compile(r"\((?P<worker>\w+) pid=(?P<pid>\d+)\).*?(?:Model loading took (?P<gib>[\d.]+) GiB and "
                        r"(?P<model_s>[\d.]+) seconds|Loading weights took (?P<weights_s>[\d.]+) seconds)")


def worker_load_times(log_text: str) -> dict[str, dict[str, float]]:
    """Per worker (its log prefix, ``DiffusionWorker_FS0`` ...): vllm-omni's own load-phase lines --
    ``model_s`` from "Model loading took X GiB and Y seconds" (the runner's whole ``load_model``, with our
    door as without) and ``weights_s`` from "Loading weights took Y seconds" (its ``load_weights``)."""
    found: dict[str, dict[str, float]] = {}
    for match in _OMNI_LOAD.finditer(log_text):
        entry = found.setdefault(match["worker"], {"pid": int(match["pid"])})
        if match["model_s"]:
            entry["model_s"], entry["model_gib"] = float(match["model_s"]), float(match["gib"])
        else:
            entry["weights_s"] = entry.get("weights_s", 0.0) + float(match["weights_s"])
    return dict(sorted(found.items()))


def bytes_per_rank(reports: list[dict[str, str]]) -> dict[int, int]:
    """DiT bytes read from the checkpoint by each rank, all components together."""
    per_rank: dict[int, int] = {}
    for report in reports:
        rank = int(report.get("rank", 0))
        per_rank[rank] = per_rank.get(rank, 0) + int(report.get("bytes_read", 0))
    return dict(sorted(per_rank.items()))
