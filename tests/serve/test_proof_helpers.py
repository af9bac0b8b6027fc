"""The serving proof's log parsing, without servers: it reads exactly the line our load path writes."""

from vllm_diffusion_plugin.tools import servers as sp

from vllm_diffusion_plugin.engine import report as engine_report


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


def test_a_server_whose_port_was_taken_is_started_again_on_another(tmp_path, monkeypatch):
    """``free_port`` closes the port before the server binds it; another process can take it in between (seen: a
    gloo rendezvous of the main suite beside the serve stage). ``serve`` starts the server again on another port
    instead of failing the test; the first log is kept. A real process and real sockets: the stand-in server exits
    with vLLM's "Address already in use" when its port is taken, and answers ``/health`` otherwise."""
    import socket
    import sys
    from pathlib import Path

    server = ("import http.server, sys\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
              "try:\n"
              "    s = http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H)\n"
              "except OSError as e:\n"
              "    print('OSError: [Errno 98] Address already in use', flush=True); sys.exit(1)\n"
              "s.serve_forever()\n")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], sp.free_port()])
    monkeypatch.setattr(sp, "free_port", lambda: next(ports))
    monkeypatch.setattr(sp, "server_command", lambda spec, port: [sys.executable, "-c", server, str(port)])
    try:
        run = sp.serve(sp.ServerSpec("stand-in", Path("/unused"), plugin=False), tmp_path,
                       request=lambda port, timeout_s, log: b"answered", ready_timeout_s=60)
    finally:
        taken.close()
    assert run.answers == [b"answered"]
    assert "Address already in use" in (tmp_path / "stand-in.port-taken-1.log").read_text()
