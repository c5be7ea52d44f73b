"""gpullm_lessons.bench.profiling: Nsight Compute's CSV read into per-version rows; the ceilings beside the datasheet."""
import pytest

from gpullm_lessons.bench import kernels as bench, profiling

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


def _ncu(rows):
    return {"card": "card", "date": "d", "rows": rows}


def test_counters_put_the_dram_bytes_beside_the_benchmarks_minimum():
    ncu = _ncu([
        {"op": "softmax", "backend": "hip", "version": "v3", "kernels": 1, "duration_us": 68.0, "dram_bytes": 190e6,
         "dram_pct_of_peak": 58.0, "achieved_occupancy_pct": 93.0, "registers_per_thread": 16.0,
         "ld_sectors_per_request": 4.0, "grid_size": 16384.0, "top_stalls": [["long_scoreboard", 17.0]]},
        {"op": "softmax", "backend": "hip", "version": "v4", "kernels": 1, "duration_us": 79.0, "dram_bytes": 320e6,
         "dram_pct_of_peak": 84.0, "achieved_occupancy_pct": 90.0, "registers_per_thread": 21.0,
         "ld_sectors_per_request": 4.0, "grid_size": 2048.0, "top_stalls": []},
        {"op": "layernorm", "backend": "hip", "version": "v5", "kernels": 2, "duration_us": 53.0, "dram_bytes": 1e6,
         "top_stalls": []},
        {"op": "softmax", "backend": "torch", "version": "2.11", "kernels": 2, "duration_us": 91.0,
         "dram_bytes": 360e6, "top_stalls": []},                       # no benchmark row: no ratio, not a guess
    ])
    kernels = {"rows": [{"op": "softmax", "backend": "hip", "version": v, "bytes": 200e6} for v in ("v3", "v4")]
               + [{"op": "softmax", "backend": "numba", "version": "v4", "bytes": 1.0}]}
    rows = {(r["backend"], r["version"]): r for r in profiling.counters(ncu, kernels, "softmax")}
    assert set(rows) == {("hip", "v3"), ("hip", "v4"), ("torch", "2.11")}        # layernorm left out
    assert rows[("hip", "v3")]["moved"] == pytest.approx(0.95)
    assert rows[("hip", "v4")]["moved"] == pytest.approx(1.6)                     # its own row, not numba's
    assert rows[("torch", "2.11")]["moved"] is None
    assert rows[("hip", "v3")]["top_stall"] == "long_scoreboard" and rows[("hip", "v4")]["top_stall"] is None
    table = profiling.format_counters(ncu, kernels, "softmax")
    assert "   1.60" in table and "   0.95" in table
    assert all(len(line) <= 120 for line in table.splitlines())


def test_the_stored_counters_cover_every_version_of_the_four_ops():
    from gpullm_lessons.bench import stored
    ncu, kernels = stored.load("ncu_h200"), bench.stored_kernels()
    for op in ("softmax", "layernorm", "crossentropy", "adamw"):
        rows = profiling.counters(ncu, kernels, op)
        ours = [r for r in rows if r["backend"] != "torch"]
        bench_versions = {(r["backend"], r["version"]) for r in kernels["rows"] if r["op"] == op and r["backend"] != "torch"}
        assert {(r["backend"], r["version"]) for r in ours} == bench_versions, op
        assert all(r["moved"] and 0.5 < r["moved"] < 5 for r in ours), op


@pytest.mark.parametrize("name, family", [
    ("nvjet_sm90_tss_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm (cuBLAS)"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm (cuBLAS)"),
    ("cupy_add__float32_float32_float32", "CuPy elementwise / reduction"),
    ("layernorm_backward_v5_w4_k3", "layernorm_backward_v5_w4_k3"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::Foo>(int, float*)",
     "void at::native::vectorized_elementwise_kernel"),
])
def test_kernel_families(name, family):
    assert profiling.kernel_family(name) == family


def test_a_step_spans_from_its_first_call_to_its_last_gpu_work():
    ev = [{"kind": "phase", "name": "step", "ts": 0.0, "dur": 100.0},
          {"kind": "runtime", "name": "cudaLaunchKernel", "ts": 5.0, "dur": 1.0},
          {"kind": "kernel", "name": "k", "ts": 7.0, "dur": 10.0},
          {"kind": "memcpy", "name": "m", "ts": 20.0, "dur": 3.0},
          {"kind": "runtime", "name": "cudaDeviceSynchronize", "ts": 90.0, "dur": 2.0}]
    assert profiling.step_span(ev) == pytest.approx(18.0)
    assert profiling.step_span([e for e in ev if e["kind"] != "kernel" and e["kind"] != "memcpy"]) == 0.0


def test_the_stored_timelines_show_the_graph_step_without_launch_gaps():
    from gpullm_lessons.bench import stored
    from gpullm_lessons import viz
    for name in ("timeline_course_h200", "timeline_gpt2_h200"):
        t = stored.load(name)
        fams = profiling.kernel_families(t, "graph")
        assert sum(n for _, n, _ in fams) == t["graph"]["kernels"]
        assert fams[0][0] == "gemm (cuBLAS)"
        eager, graph = t["eager"], t["graph"]
        assert abs(eager["gpu_busy_us"] - graph["gpu_busy_us"]) < 0.05 * graph["gpu_busy_us"]   # same kernels
        assert graph["span_us"] < eager["span_us"]                       # the graph removes the GPU's waiting
        assert graph["span_us"] == pytest.approx(profiling.step_span(graph["events"]))
        text = profiling.format_timeline(t) + "\n" + profiling.format_kernel_families(t)
        assert all(len(line) <= 100 for line in text.splitlines())
    fig = viz.plot_step_timeline(t)
    assert len(fig.axes) == 2 and fig.axes[1].get_xlim()[1] >= graph["span_us"] / 1e3


def test_the_kernel_table_shows_gpu_time_and_host_time_for_every_row():
    result = bench.stored_kernels()
    ok = [r for r in result["rows"] if "error" not in r]
    assert ok and all("host_ms" in r and r["host_ms"] > 0 for r in ok)
    numba = [r for r in ok if r["backend"] == "numba"]
    assert numba and sum(r["timing"] == "graph" for r in numba) >= len(numba) - 1   # Numba captured like CuPy
    table = bench.format_kernels(result)
    assert "host us" in table and all(len(line) <= 100 for line in table.splitlines())
    row = next(r for r in ok if r["backend"] == "numba" and r["timing"] == "graph")
    line = next(ln for ln in table.splitlines() if ln.startswith(f"{row['op']:<13}numba   {row['version']}"))
    assert f"{row['ms']:7.3f}g" in line and f"{1e3 * row['host_ms']:9.0f}" in line


def test_pipe_counters_come_from_the_kernel_that_dominates():
    """The pipes' busy fractions (integer/compare alu, fma, tensor cores, special functions) are read, and a
    version's line takes them from its longest kernel, as its other counters."""
    header = [
        "ID",
        "Kernel Name",
        "Grid Size",
        "gpu__time_duration.sum",
        "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
        "smsp__inst_executed.sum",
    ]
    q = lambda r: ",".join(f'"{c}"' for c in r)  # noqa: E731
    text = "\n".join(
        [
            q(header),
            q(["", "", "", "nsecond", "%", "%", "%", "inst"]),
            q(["1", "bench_marker", "(1, 1, 1)", "2", "0", "0", "0", "1"]),
            q(["2", "delta(float*)", "(9, 1, 1)", "50", "80.5", "0", "3", "1,000"]),
            q(["3", "main(float*)", "(9, 1, 1)", "400", "11.25", "30.5", "10", "70,000"]),
        ]
    )
    kernels = profiling._attribute(profiling.parse_ncu_csv(text), [{"op": "f", "backend": "hip", "version": "v5"}])
    assert kernels[1]["instructions"] == 70000.0 and kernels[0]["pipe_alu_pct"] == 80.5
    (row,) = profiling.summarise(kernels)
    assert (row["pipe_alu_pct"], row["pipe_tensor_pct"], row["pipe_xu_pct"]) == (11.25, 30.5, 10.0)
    assert row["instructions"] == 70000.0 and row["issue_active_pct"] is None  # not in this CSV


def test_format_pipes_shows_each_version_of_one_op():
    """format_pipes: one line per version of the op asked for (other ops left out), the counters it has, '-' for one
    the toolkit did not give, and the largest stall."""
    row = {"op": "f", "backend": "hip", "duration_us": 120.5, "issue_active_pct": 44.1, "pipe_tensor_pct": 29.6,
           "pipe_alu_pct": 25.0, "pipe_fma_pct": 16.1, "pipe_xu_pct": 25.9, "achieved_occupancy_pct": 12.1,
           "instructions": 58.9e6, "top_stalls": [("wait", 1.76), ("selected", 1.0)]}
    result = {"card": "GPU", "date": "2026-01-01",
              "rows": [dict(row, version="v5"), dict(row, version="v6", pipe_xu_pct=None), dict(row, op="g", version="v9"),
                       dict(row, backend="torch", version="2.11.0+cu130")]}
    lines = profiling.format_pipes(result, "f").splitlines()
    assert len(lines) == 5 and "GPU (2026-01-01)" in lines[0] and lines[4].startswith("PyTorch ")
    assert max(map(len, lines)) <= 100
    v5, v6 = lines[2].split(), lines[3].split()
    assert v5[:9] == ["v5", "120.5", "44", "30", "25", "16", "26", "12", "58.9"] and v5[9:] == ["wait", "1.8"]
    assert v6[6] == "-" and not any("v9" in ln for ln in lines)
