"""The serving proof's log parsing, without servers: it reads exactly the line our load path writes."""

import pytest
import serve_proof as sp

load_path = pytest.importorskip("vllm_diffusion_plugin.doors.omni.load_path",
                                reason="the vllm-omni door's load path is not on this branch")
ComponentLoadReport = load_path.ComponentLoadReport


def test_the_prefix_is_the_load_paths():
    assert sp.REPORT_PREFIX == load_path.REPORT_PREFIX


def test_load_reports_parse_our_load_paths_line_from_a_worker_log():
    lines = [ComponentLoadReport(component=c, rank=r, world_size=2, strategy="rank_local", bytes_read=100 * (r + 1)).line()
             for c in ("transformer", "transformer_2") for r in (0, 1)]
    log = "\n".join(f"(DiffusionWorker_FS{i % 2} pid=1) INFO 12-02 19:09:49 [patch_load_path.py:244] {line}"
                    for i, line in enumerate(lines)) + "\nINFO unrelated line bytes_read=7\n"
    reports = sp.load_reports(log)
    assert [(r["component"], r["rank"], r["strategy"]) for r in reports] == [
        ("transformer", "0", "rank_local"), ("transformer", "1", "rank_local"),
        ("transformer_2", "0", "rank_local"), ("transformer_2", "1", "rank_local")]
    assert sp.bytes_per_rank(reports) == {0: 200, 1: 400}
