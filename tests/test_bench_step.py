"""CPU (CI): the training-step report ``python -m coda.bench --model`` -- kernel classes, FLOP counts, rendering."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from coda.bench import step as S
from coda.bench import step_report as SR

KERNELS = {
    # ours (CuTeDSL) and cuBLAS
    "kernel_cutlass_kernel_coda_kernels_gemm_sm90_GemmSm90_object_at__tensorptrbf16gmemalign16": "gemm",
    "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT": "gemm",
    "kernel_cutlass_kernel_codakernelsgemm_sm90GemmSm90_rms_swiglu_tensorptrbf16gmemalign16": "gemm",
    "kernel_cutlass_kernel_codakernelsgemm_sm90GemmSm90_adamw_fold_tensorptrbf16gmemalign16": "gemm",
    "kernel_cutlass_kernel_codakernelsgemm_sm90GemmSm90_adamw_scaled_tensorptrbf16gmemalign16": "optimizer",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel"
    "__5x_cublas": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(T1::Params)": "gemm",
    "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>": "gemm",
    "triton_tem_fused_mm_0": "gemm",
    # attention: flash (it names cutlass types), cuDNN, memory-efficient
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t, "
    "Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, "
    "false>(pytorch_flash::Flash_fwd_params)": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8>>":
        "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0": "attention",
    "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch::Sm80>)":
        "attention",
    # optimizer
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<c10::BFloat16, 4, "
    "(at::native::ADAM_MODE)1, false>, double, double, double, double, double, bool, float const*, float const*>":
        "optimizer",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<2>, at::native::(anonymous namespace)::PointwiseOpScalarFunctor<float, 2, 2, 0>>": "optimizer",
    # everything else: Triton pointwise / reductions (even when named after a fused mm), torch elementwise, copies
    "triton_poi_fused__to_copy_add_mul_0": "other",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": "other",
    "triton_poi_fused_add_mm_3": "other",
    "triton_per_fused__log_softmax_backward_data_nll_loss_backward_2": "other",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)": "other",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
    "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, "
    "unsigned int, float, 4, 4>)": "other",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>":
        "other",
    "Memcpy DtoD (Device -> Device)": "other",
    # cuDNN SDPA backward's own auxiliary kernels
    "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, void*, void*, unsigned int)":
        "attention",
    "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int, unsigned int)": "attention",
    "void cudnn::fusion::fmha_reduce_head<true>(void const*, void*, unsigned int, unsigned int)": "attention",
    "kernel_cutlass_softmax_grad_kernel_coda_kernels_ce_grad": "other",
    # the QKV backward's RoPE pass (H100 profile, session 32): memory-bound, not a GEMM
    "kernel_cutlass_kernel_codakernelsrope_grad_kernel_classlocalsRopeGradSm90_object_at__tensorptrbf16gmemalign16o":
        "other",
    # cuBLAS SGEMV finishing the epilogues' column partials (kernels.epilogue._sum_tiles; H100 profile, session 31)
    "std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, float, float, float, float, false, true, "
    "false, false, 6, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, "
    "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float> >": "other",
}


@pytest.mark.parametrize("name,cls", sorted(KERNELS.items()))
def test_classify_real_kernel_names(name, cls):
    assert SR.classify(name) == cls


def test_flops_of_llama_1b_by_hand():
    h, i, v, n, kv = 2048, 8192, 128256, 16, 8 * 64
    per_layer = h * h + h * kv + h * kv + h * h + 3 * h * i   # q k v o, gate up down
    params = n * per_layer + h * v                             # + lm_head
    assert params == 1_235_746_816
    m = 2 * 4096
    f = SR.step_flops(S.PRESETS["llama-1b"], 2, 4096)
    assert f["gemm"] == 6 * m * params
    # causal attention: QK^T and PV, 2 * B * heads * T^2 * d FLOPs each, half under the mask, x3 for fwd+bwd
    assert f["attention"] == 3 * n * 2 * (2 * 2 * 32 * 4096 ** 2 * 64) // 2
    assert f["total"] == f["gemm"] + f["attention"]
    assert 60.7e12 < f["gemm"] < 60.8e12


def _fake_report():
    kernels_stock = {"nvjet_tst_a": 80.0, "pytorch_flash::flash_fwd_kernel": 20.0,
                     "multi_tensor_apply_kernel<FusedAdamMathFunctor>": 8.0, "triton_poi_fused_add_0": 12.0,
                     "triton_red_fused_pow_1": 3.0}
    kernels_fused = {"kernel_cutlass_kernel_GemmSm90": 85.0, "pytorch_flash::flash_fwd_kernel": 20.0,
                     "multi_tensor_apply_kernel<FusedAdamMathFunctor>": 8.0, "triton_poi_fused_add_0": 4.0}
    meta = dict(model="llama-1b", config=S.PRESETS["llama-1b"], batch=2, seq=4096, steps=3, warmup=1,
                optimizer="adamw-fused", dtype="bfloat16", commit="abc", dirty=False, date="2026-11-26",
                autotune="0", cutlass_dsl="4.8.1", device="NVIDIA H100 80GB HBM3", torch="2.11")
    return dict(schema=1, meta=meta, gemm_peak_tflops=750.0, flops=SR.step_flops(S.PRESETS["llama-1b"], 2, 4096),
                modes=[dict(mode="stock+compile", step_ms_all=[130.0, 125.0, 128.0], loss=5.0, first_step_s=60.0,
                            peak_bytes=21.5e9, kernels=kernels_stock),
                       dict(mode="fused", step_ms_all=[120.0, 118.0, 500.0], loss=5.0, first_step_s=20.0,
                            first_step_phases={"build the model": 7.5, "first step": 9.25},
                            peak_bytes=19e9, kernels=kernels_fused, head_ms=19.5),
                       dict(mode="fused+compile", error="exit 1: boom")])


def test_summary_arithmetic():
    r = SR.summarize(_fake_report())
    sc, fu = r["modes"][0], r["modes"][1]
    assert sc["step_ms"] == 128.0 and fu["step_ms"] == 120.0          # medians: an outlier step does not count
    assert fu["tok_s"] == pytest.approx(8192 / 0.120)
    assert fu["vs_stock_compile"] == pytest.approx(128.0 / 120.0)
    assert sc["classes"] == {"gemm": 80.0, "attention": 20.0, "optimizer": 8.0, "other": 15.0}
    assert [k for k, _ in sc["top_other"]] == ["triton_poi_fused_add_0", "triton_red_fused_pow_1"]
    gemm_ms = r["flops"]["gemm"] / 750e12 * 1e3
    assert r["sol"]["ms"] == pytest.approx(gemm_ms + 20.0 + 8.0)
    assert fu["pct_sol"] == pytest.approx(100 * r["sol"]["ms"] / 120.0)
    assert fu["mfu_measured"] == pytest.approx(r["flops"]["total"] / 0.120 / 750e12)
    assert fu["mfu_datasheet"] == pytest.approx(r["flops"]["total"] / 0.120 / 989.4e12)


def test_from_renders_without_gpu(tmp_path):
    src = tmp_path / "saved.json"
    src.write_text(json.dumps(_fake_report()))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "coda.bench", "--from", str(src), "--model", "llama-1b",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    md = (out / "report.md").read_text()
    assert "| fused | 68.3k | 1.067x | 120.0 |" in md
    printed = proc.stdout.splitlines()  # the modes table on stdout too (a remote run's log keeps it)
    assert printed[printed.index(next(x for x in printed if x.startswith("| mode |"))) + 2].startswith("| ")
    assert any(x.startswith("| fused | 68.3k | 1.067x | 120.0 |") for x in printed)
    assert not any(x.startswith("| ms/step |") for x in printed)  # the kernel tables stay in the file
    assert md.count(" | 19.5 |") == 1 and "LM head ms: the final norm + LM head + loss alone" in md   # the fused mode's head share only
    assert "failed: exit 1: boom" in md
    assert "`triton_poi_fused_add_0`" in md
    assert "by phase (s): **fused** build the model 7.5, first step 9.2" in md
    # the step's time outside the profiled kernels (128 - 123 ms; 120 - 117) and the timed steps' range
    assert "(min-max ms): **stock+compile** 5.0, 125.0-130.0; **fused** 3.0, 118.0-500.0." in md
    saved = json.loads((out / "report.json").read_text())
    assert saved["sol"]["ms"] == pytest.approx(SR.summarize(_fake_report())["sol"]["ms"])
    try:
        import matplotlib  # noqa: F401
        assert (out / "step.png").stat().st_size > 1000
    except ImportError:
        assert not (out / "step.png").exists()


def test_modes_are_checked():
    assert S.parse_modes("stock, fused+compile") == ["stock", "fused+compile"]
    with pytest.raises(ValueError, match="--modes"):
        S.parse_modes("stock,fast")


def test_batches_are_deterministic_and_in_range():
    a = S.make_batches(97, 2, 16, 2, seed=3)
    b = S.make_batches(97, 2, 16, 2, seed=3)
    assert all((x == y).all() for x, y in zip(a, b))
    assert all(int(x.min()) >= 0 and int(x.max()) < 97 for x in a)
    # every token follows the chain: one of its predecessor's 4 successors (the reports' token streams are those of
    # the torch-op loop this replaced: the same draws, compared in float32)
    g = torch.Generator().manual_seed(3)
    succ = torch.randint(0, 97, (97, 4), generator=g)
    for x in a:
        assert all(int(t) in succ[int(p)].tolist() for row in x for p, t in zip(row[:-1], row[1:]))


def test_tiny_cpu_run_end_to_end(tmp_path):
    """The whole pipeline on the CPU reference path: two modes, each in its own process, the report rendered."""
    proc = subprocess.run([sys.executable, "-m", "coda.bench", "--model", "tiny", "--device", "cpu", "--seq", "16",
                           "--steps", "2", "--warmup", "1", "--modes", "stock,fused", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rep = json.loads((tmp_path / "report.json").read_text())
    assert [m["mode"] for m in rep["modes"]] == ["stock", "fused"]
    losses = [m["loss"] for m in rep["modes"]]
    assert all(math.isfinite(x) for x in losses) and losses[0] == pytest.approx(losses[1], rel=0.05)


def test_env_variants_alternate_in_rounds(tmp_path):
    """--env adds a variant of each mode run with those environment variables (its worker sees them, the mode's
    does not); --rounds 2 alternates them and pools the step times (a median per round kept)."""
    env = {k: v for k, v in os.environ.items() if k != "CODA_PRECOMPILE"}
    proc = subprocess.run([sys.executable, "-m", "coda.bench", "--model", "tiny", "--device", "cpu", "--seq", "16",
                           "--steps", "2", "--warmup", "1", "--profile-steps", "0", "--modes", "fused",
                           "--env", "CODA_PRECOMPILE=0", "--rounds", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "x fused's" in proc.stdout
    # the report is written after each of the four runs (a run cut short keeps the ones before it), then the mode's
    assert sum(ln.startswith("wrote") and ln.endswith("report.json") for ln in proc.stdout.splitlines()) == 5
    rep = json.loads((tmp_path / "report.json").read_text())
    assert [m["mode"] for m in rep["modes"]] == ["fused", "fused [CODA_PRECOMPILE=0]"]
    base, var = rep["modes"]
    assert "CODA_PRECOMPILE" not in base["coda_env"] and var["coda_env"]["CODA_PRECOMPILE"] == "0"
    assert len(base["rounds_ms"]) == len(var["rounds_ms"]) == 2 and len(var["step_ms_all"]) == 4
    bad = subprocess.run([sys.executable, "-m", "coda.bench", "--model", "tiny", "--env", "NOVALUE"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--env" in bad.stderr
    # --env-only: the variant alone (a call's time for it, not for the unmodified mode first)
    only = tmp_path / "only"
    proc = subprocess.run([sys.executable, "-m", "coda.bench", "--model", "tiny", "--device", "cpu", "--seq", "16",
                           "--steps", "2", "--warmup", "1", "--profile-steps", "0", "--modes", "fused",
                           "--env", "CODA_PRECOMPILE=0", "--env-only", "--out", str(only)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rep = json.loads((only / "report.json").read_text())
    assert [m["mode"] for m in rep["modes"]] == ["fused [CODA_PRECOMPILE=0]"]
    assert rep["modes"][0]["coda_env"]["CODA_PRECOMPILE"] == "0"
    bad = subprocess.run([sys.executable, "-m", "coda.bench", "--model", "tiny", "--env-only"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--env-only" in bad.stderr


def test_tiny_cpu_run_on_two_processes_with_fsdp2(tmp_path):
    """--nproc 2 on the CPU (gloo): each mode under torch.distributed.run, FSDP2 over the (fused) model, rank 0's
    numbers reported, tokens/s over both processes in the rendered report; the loss is rank 0's batch's."""
    proc = subprocess.run([sys.executable, "-m", "coda.bench", "--model", "tiny", "--device", "cpu", "--seq", "16",
                           "--steps", "2", "--warmup", "1", "--profile-steps", "0", "--modes", "stock,fused",
                           "--nproc", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["meta"]["nproc"] == 2
    assert [(m["mode"], m["nproc"], m["rank"]) for m in rep["modes"]] == [("stock", 2, 0), ("fused", 2, 0)]
    losses = [m["loss"] for m in rep["modes"]]
    assert all(math.isfinite(x) for x in losses) and losses[0] == pytest.approx(losses[1], rel=0.05)
    assert all("FSDP2" in m["first_step_phases"] for m in rep["modes"])
    md = (tmp_path / "report.md").read_text()
    assert "2 processes, one GPU each, FSDP2" in md and "tokens/s and MFU are per GPU" in md


@pytest.mark.parametrize("mod", ["attention", "layer", "step_ops", "step_epilogues", "step_gaps"])
def test_step_benches_share_the_shape_arguments(mod, capsys):
    """The benches of one part of the step take the step's --model / --batch / --seq (one parser, S.shape_parser):
    --help works without a GPU and lists them; an unknown preset is refused by name."""
    import importlib
    m = importlib.import_module(f"coda.bench.{mod}")
    with pytest.raises(SystemExit) as e:
        m.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(f"--{a}" in out for a in ("model", "batch", "seq")), out
    with pytest.raises(SystemExit) as e:
        m.main(["--model", "no-such-model"])
    assert e.value.code == 2 and "no-such-model" in capsys.readouterr().err


def test_head_share_computes_the_models_own_loss():
    """coda.bench.step_head: the fused head's loss (deferred norm + LMHeadCrossEntropy) on a hidden state equals the
    stock head's (norm, LM head, fp32 cross entropy on the shifted labels), and both equal the model's own forward
    on the backbone's pre-norm hidden state."""
    import copy

    import torch

    import coda
    from coda.bench.step_head import head_loss
    torch.manual_seed(0)
    stock = S.build_model(S.PRESETS["tiny"], 16)[0]
    fused = coda.fuse(copy.deepcopy(stock))
    ids = torch.randint(0, S.PRESETS["tiny"]["vocab"], (2, 16))
    h = torch.randn(2, 16, S.PRESETS["tiny"]["hidden"])
    a, b = head_loss(stock, False, ids)(h), head_loss(fused, True, ids)(h)
    assert a.item() == pytest.approx(b.item(), rel=1e-4)
    pre = {}
    stock.model.norm.register_forward_hook(lambda m, i, o: pre.setdefault("h", i[0]))
    loss = stock(ids, labels=ids)
    assert head_loss(stock, False, ids)(pre["h"]).item() == pytest.approx(loss.item(), rel=1e-6)


def test_power_window_and_the_report_line(tmp_path, monkeypatch):
    """--power (coda.bench.power): nvidia-smi's samples in the timed window, averaged; the report's line per mode
    with W, MHz and joules a step; a fake nvidia-smi on PATH stands in for the GPU's (lines it cannot parse are
    skipped), none on PATH gives no samples."""
    import time
    from coda.bench import power
    assert power.window([(1.0, 600.0, 1500.0), (2.0, 700.0, 1400.0), (3.0, 10.0, 10.0)], 0.5, 2.5) == {
        "w": 650.0, "mhz": 1450.0, "samples": 2}
    assert power.window([(1.0, 600.0, 1500.0)], 2.0, 3.0) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-abc")
    assert power.smi_id(1) == "GPU-abc" and power.smi_id(0) == "3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert power.smi_id(2) == "2"
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '[N/A], [N/A]'\nwhile true; do echo '690.5, 1410'; sleep 0.02; done\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    s = power.Sampler("0", ms=20)
    time.sleep(0.5)
    s.stop()
    got = power.window(s.samples, 0.0, time.time())
    assert got is not None and got["w"] == 690.5 and got["mhz"] == 1410.0 and got["samples"] >= 2
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert power.Sampler("0").samples == [] and power.Sampler("0").stop() is None
    rep = _fake_report()
    rep["modes"][1]["power"] = {"w": 690.0, "mhz": 1500.0, "samples": 40}
    md = SR.render_markdown(rep, image=None)
    assert "**fused** 690 W at 1500 MHz, 82.8 J a step." in md and "**stock+compile** 6" not in md
    assert "Power while the timed steps ran" not in SR.render_markdown(_fake_report(), image=None)
