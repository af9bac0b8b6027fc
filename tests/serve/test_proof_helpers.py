"""The serving proof's log parsing, without servers: it reads exactly the line our load path writes."""

from pathlib import Path

import pytest

from vllm_diffusion_plugin.engine import report as engine_report
from vllm_diffusion_plugin.tools import servers as sp


def test_the_prefix_is_the_load_paths():
    assert sp.REPORT_PREFIX == engine_report.REPORT_PREFIX


def test_load_reports_parse_our_load_paths_line_from_a_worker_log():
    lines = [engine_report.report_line(engine_report.LoadReport(rank=r, world_size=2, strategy="rank_local"),
                                       engine_report.ComponentReport(name=c, class_name="X", bytes_read=100 * (r + 1)))
             for c in ("transformer", "transformer_2") for r in (0, 1)]
    log = "\n".join(f"(DiffusionWorker_FS{i % 2} pid=1) INFO 12-02 19:09:49 [patch_load_path.py:244] {line}"
                    for i, line in enumerate(lines)) + "\nINFO unrelated line bytes_read=7\n"
    reports = sp.load_reports(log)
    assert [(r["component"], r["rank"], r["strategy"]) for r in reports] == [
        ("transformer", "0", "rank_local"), ("transformer", "1", "rank_local"),
        ("transformer_2", "0", "rank_local"), ("transformer_2", "1", "rank_local")]
    assert sp.bytes_per_rank(reports) == {0: 200, 1: 400}


STAND_IN = ("import http.server, sys\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
            "try:\n"
            "    s = http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H)\n"
            "except OSError as e:\n"
            "    print('OSError: [Errno 98] Address already in use', flush=True); sys.exit(1)\n"
            "if sys.argv[2] == 'refuse':\n"
            "    print('refused: a bad option', flush=True); sys.exit(2)\n"
            "s.serve_forever()\n")
"""A stand-in server, a real process on real sockets: exits with vLLM's "Address already in use" when its port is
taken; otherwise refuses (``refuse``) or answers ``/health``."""


@pytest.fixture
def port_taken_once(monkeypatch):
    """``free_port`` hands out a port another process holds, then a free one; servers are the stand-in."""
    import socket
    import sys

    def command(behaviour):
        monkeypatch.setattr(sp, "server_command", lambda spec, port: [sys.executable, "-c", STAND_IN, str(port),
                                                                      behaviour])

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], sp.free_port()])
    monkeypatch.setattr(sp, "free_port", lambda: next(ports))
    yield command
    taken.close()


def test_a_server_whose_port_was_taken_is_started_again_on_another(tmp_path, port_taken_once):
    """``free_port`` closes the port before the server binds it; another process can take it in between (seen: a
    gloo rendezvous of the main suite beside the serve stage). ``serve`` starts the server again on another port
    instead of failing the test; the first log is kept."""
    port_taken_once("serve")
    run = sp.serve(sp.ServerSpec("stand-in", Path("/unused"), plugin=False), tmp_path,
                   request=lambda port, timeout_s, log: b"answered", ready_timeout_s=60)
    assert run.answers == [b"answered"]
    assert "Address already in use" in (tmp_path / "stand-in.port-taken-1.log").read_text()


def test_a_refused_start_is_not_mistaken_for_a_taken_port(tmp_path, port_taken_once):
    """``refused_start`` waits for the refusal: a server that lost its port is started again, its refusal returned."""
    port_taken_once("refuse")
    status, log, _ = sp.refused_start(sp.ServerSpec("stand-in", Path("/unused"), plugin=False), tmp_path, timeout_s=60)
    assert status == 2 and "refused: a bad option" in log, (status, log)
    assert "Address already in use" in (tmp_path / "stand-in.port-taken-1.log").read_text()
