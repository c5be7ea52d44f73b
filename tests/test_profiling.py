"""gpullm_lessons.profiling: Nsight Compute's CSV read into per-version rows; the ceilings beside the datasheet."""
import pytest

from gpullm_lessons import bench, profiling

HEADER = ['ID', 'Kernel Name', 'Grid Size', 'gpu__time_duration.sum', 'dram__bytes_read.sum',
          'dram__bytes_write.sum', 'dram__throughput.avg.pct_of_peak_sustained_elapsed',
          'launch__registers_per_thread', 'l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum',
          'l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum',
          'smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio',
          'smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio']
UNITS = ['', '', '', 'nsecond', 'byte', 'byte', '%', 'register/thread', 'sector', '', 'inst', 'inst']


def _csv(rows):
    q = lambda r: ",".join(f'"{c}"' for c in r)  # noqa: E731
    return "\n".join(["==PROF== Connected to process 1", q(HEADER), q(UNITS), *map(q, rows),
                      "==PROF== Disconnected"])


def test_ncu_rows_are_attributed_to_the_version_after_each_marker():
    text = _csv([
        ["1", "bench_marker", "(1, 1, 1)", "2", "0", "0", "0", "16", "0", "0", "0", "0"],
        ["2", "softmax_v1(float*)", "(64, 1, 1)", "1,200", "4000", "2000", "45.5", "32", "800", "100", "9.5", "0.5"],
        ["3", "bench_marker", "(2, 1, 1)", "2", "0", "0", "0", "16", "0", "0", "0", "0"],
        ["4", "partial(float*)", "(8, 1, 1)", "100", "10", "10", "5", "40", "4", "1", "1", "3"],
        ["5", "finish(float*)", "(8, 1, 1)", "300", "20", "20", "60", "24", "16", "4", "2", "7"],
    ])
    labels = [{"op": "softmax", "backend": "hip", "version": "v1"}, {"op": "softmax", "backend": "hip", "version": "v2"}]
    kernels = profiling._attribute(profiling.parse_ncu_csv(text), labels)
    assert [(k["version"], k["kernel"].split("(")[0]) for k in kernels] == [("v1", "softmax_v1"), ("v2", "partial"),
                                                                             ("v2", "finish")]
    assert kernels[0]["duration_ns"] == 1200.0               # thousands separators read as numbers
    rows = {r["version"]: r for r in profiling.summarise(kernels)}
    assert rows["v1"]["ld_sectors_per_request"] == 8.0
    assert rows["v1"]["top_stalls"][0] == ("long_scoreboard", 9.5)
    assert rows["v2"]["kernels"] == 2 and rows["v2"]["duration_us"] == pytest.approx(0.4)
    assert rows["v2"]["main_kernel"].startswith("finish")    # the longer kernel speaks for the version
    assert rows["v2"]["dram_bytes"] == 60
    assert rows["v2"]["top_stalls"][0] == ("barrier", 7.0)
    table = profiling.format_ncu({"card": "card", "date": "d", "rows": list(rows.values())})
    assert "long_scoreboard 9.5" in table and all(len(line) <= 100 for line in table.splitlines())


def test_a_kernel_before_the_first_marker_belongs_to_no_version():
    text = _csv([["0", "warmup(float*)", "(4, 1, 1)", "9", "0", "0", "0", "16", "0", "0", "0", "0"]])
    assert profiling._attribute(profiling.parse_ncu_csv(text), [{"op": "x", "backend": "b", "version": "v"}]) == []


def test_ceilings_are_shown_beside_the_datasheet():
    c = bench.stored_ceilings()
    text = bench.format_ceilings(c)
    spec = bench.spec_peaks(c["card"])
    assert spec is not None and f"{spec['hbm_GB/s']:6.0f}" in text
    frac = 100 * c["copy"]["GB/s"] / spec["hbm_GB/s"]
    assert f"{frac:3.0f}% of spec" in text
    assert bench.spec_peaks("a card nobody measured") is None
    assert all(len(line) <= 100 for line in text.splitlines())
