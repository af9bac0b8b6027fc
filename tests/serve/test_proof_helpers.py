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
