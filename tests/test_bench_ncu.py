"""coda.bench.ncu on the CPU: parsing Nsight Compute's raw CSV, the table, argument errors (the profiling itself
needs ncu and a Hopper GPU)."""
import pytest

from coda.bench import ncu as bench_ncu

NVTX = "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg"
COLS = ["ID", NVTX, "Kernel Name"] + list(bench_ncu.METRICS.values())
UNITS = ["", "", "", "cycle", "usecond", "%", "%", "Mbyte", "%"]


def _row(label, kernel, cycles, us, tensor, dram_mb, hit):
    cell = f'1 "<default domain>:coda_ncu:none:none"  "<default domain>:{label}:none:none" '
    return ["0", cell, kernel] + [str(v) for v in (cycles, us, tensor, tensor + 1, dram_mb, hit)]


def _csv(rows):
    import csv
    import io
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(COLS)
    w.writerow(UNITS)
    for r in rows:
        w.writerow(r)
    return buf.getvalue()


def test_metric_order_matches_the_fixture():
    assert list(bench_ncu.METRICS) == ["cycles", "ms", "tensor_elapsed", "tensor_active", "dram", "l2_hit"]


def test_parse_converts_units_and_reads_the_innermost_range():
    text = _csv([_row("cublas@8x16x32", "nvjet_sm90_tst_192x192", 2_000_000, 1250.0, 95.0, 1500.0, 80.0),
                 _row("coda@8x16x32", "kernel_cutlass_kernel_codakernelsgemm_sm90GemmSm90_x", 1_900_000, 1200.0,
                      94.0, 3000.0, 60.0)])
    rows = bench_ncu.parse_raw_csv(text)
    assert [r["label"] for r in rows] == ["cublas@8x16x32", "coda@8x16x32"]
    assert rows[1]["kernel"] == "GemmSm90" and rows[0]["kernel"].startswith("nvjet")
    assert rows[0]["ms"] == pytest.approx(1.25) and rows[0]["dram"] == pytest.approx(1.5)  # us -> ms, MB -> GB
    assert rows[1]["clock_ghz"] == pytest.approx(1_900_000 / 1.2e6)
    assert rows[1]["tensor_active"] == pytest.approx(95.0)
    md = bench_ncu.table(rows)
    line = [ln for ln in md.splitlines() if "| coda |" in ln][0]
    assert "| 0.950 |" in line  # cycles over the same shape's cuBLAS kernel: 1.9 / 2.0


def test_missing_metric_is_a_dash_not_a_crash():
    r = _row("coda@1x1x1", "GemmSm90", 10, 1.0, 1.0, 1.0, 1.0)
    r[-1] = "n/a"
    rows = bench_ncu.parse_raw_csv(_csv([r]))
    assert rows[0]["l2_hit"] is None
    assert bench_ncu.table(rows).splitlines()[-1].endswith("| - |")


def test_empty_report_parses_to_nothing():
    assert bench_ncu.parse_raw_csv("") == []


@pytest.mark.parametrize("argv", [["--shapes", "8x8"], ["--shapes", "0x8x8"], ["--epilogues", "nope"]])
def test_bad_arguments_exit_with_usage(argv):
    with pytest.raises(SystemExit) as e:
        bench_ncu.main(argv)
    assert e.value.code == 2


def test_without_ncu_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(bench_ncu.shutil, "which", lambda name: None)
    assert bench_ncu.main(["--shapes", "128x128x128"]) == 2
    assert "ncu" in capsys.readouterr().err


def test_config_option_builds_the_changed_default():
    from coda.config import GemmConfig
    label, cfg = bench_ncu.parse_config("cluster_m=1,sched=dynamic")
    assert label == "coda[cluster_m=1,sched=dynamic]"
    assert cfg == GemmConfig(cluster_m=1, sched="dynamic")
    # the base is the large-problem heuristic default (the dynamic schedule since session 13)
    assert bench_ncu.parse_config("sched=static")[1] == GemmConfig()
    assert bench_ncu.parse_config("pingpong=True,tile_m=128,tile_n=128,stages=None,sched=static")[1].pingpong


@pytest.mark.parametrize("text", ["bogus=1", "cluster_m", "tile_n=128,pingpong=True,sched=dynamic", "swizzle=0"])
def test_bad_config_is_a_usage_error(text):
    with pytest.raises(ValueError):
        bench_ncu.parse_config(text)
    with pytest.raises(SystemExit) as e:
        bench_ncu.main(["--config", text])
    assert e.value.code == 2


def test_expand_ncu_table_from_raw_csv():
    """coda.bench.expand_ncu --table: one row per NVTX range, the metric cells as ncu printed them."""
    from coda.bench.expand_ncu import METRICS, table
    head = ["ID", "Kernel Name", "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg",
            *METRICS.values()]
    units = ["", "", "", "us", *[""] * (len(METRICS) - 1)]
    row = ["0", "nvjet_x", '"<default domain>:cublas:none:none:none:none:none:none"', "366.5", "87.3", "31.6",
           "89.8", "3.0", "1.6"]
    import csv
    import io
    buf = io.StringIO()
    csv.writer(buf).writerows([head, units, row])
    out = table(buf.getvalue()).splitlines()
    assert out[0].startswith("| range | time | tensor %") and len(out) == 3
    assert out[2].startswith("| cublas | 366.5 us | 87.3 | 31.6 | 89.8 |"), out[2]
