"""bench inductor (gpullm_lessons/bench/inductor.py): what torch.compile keeps for the backward and the kernels it runs.

On the CPU: the name parsing and the tallies, on names as torch.profiler reports Inductor's kernels. On a GPU
(`make gpu-test`, torch present): the three measurements on a small GPT."""

import pytest

from gpullm_lessons.bench import inductor
from gpullm_lessons.model.params import GPTConfig


def test_fused_ops_reads_inductors_kernel_names():
    assert inductor.fused_ops("triton_poi_fused_add_gelu_mul_3") == ["add", "gelu", "mul"]
    assert inductor.fused_ops("triton_red_fused__to_copy_native_layer_norm_0") == ["to", "copy", "native", "layer",
                                                                                    "norm"]
    assert inductor.fused_ops("triton_per_fused_sum_12") == ["sum"]
    assert inductor.fused_ops("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN") is None
    assert inductor.fused_ops("triton_poi_fused_7") == []


def test_kernel_kind_by_prefix():
    assert inductor.kernel_kind("triton_poi_fused_add_0") == "generated pointwise"
    assert inductor.kernel_kind("triton_red_fused_sum_1") == inductor.kernel_kind("triton_per_fused_sum_1")
    assert inductor.kernel_kind("triton_tem_fused_mm_2") == "generated matrix product"
    assert inductor.kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "library"


def test_tensor_kinds_counts_bytes_by_shape_and_dtype():
    rows = inductor.tensor_kinds([((16, 1024, 3072), "torch.bfloat16")] * 12 + [((16, 1024), "torch.float32")] * 3)
    assert rows[0] == {"shape": [16, 1024, 3072], "dtype": "bfloat16", "count": 12, "bytes": 12 * 16 * 1024 * 3072 * 2}
    assert rows[1] == {"shape": [16, 1024], "dtype": "float32", "count": 3, "bytes": 3 * 16 * 1024 * 4}


def test_format_shows_errors_and_results():
    result = {"preset": "gpt2", "B": 16, "T": 1024, "precision": "bf16", "torch": "2.11", "card": "a card",
              "date": "2026-12-07",
              "saved": {"eager": {"bytes": 2**31, "kinds": inductor.tensor_kinds([((4, 5), "torch.float32")])},
                        "compile": {"error": "RuntimeError: no"}},
              "kernels": {"total_ms": 3.5, "by_kind": {"library": {"ms": 2.0, "kernels": 3}},
                          "rows": [{"kernel": "triton_poi_fused_add_0", "ms": 1.5}]}}  # fmt: skip
    text = inductor.format_anatomy(result)
    assert "eager: 2.00 GiB" in text and "compile: RuntimeError: no" in text and "triton_poi_fused_add_0" in text


@pytest.mark.gpu
def test_gpu_anatomy_of_a_small_gpt():
    pytest.importorskip("torch")
    from gpullm_lessons import device

    if not device.has_gpu():
        pytest.skip("needs a GPU")
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=128)
    B, T, C = 4, 64, 128
    r = inductor.torch_compile_anatomy(precision="bf16", steps=1, cfg=cfg, B=B)
    eager, comp = r["saved"]["eager"], r["saved"]["compile"]
    assert "error" not in eager and "error" not in comp, (eager, comp)
    assert 0 < comp["bytes"] <= 1.05 * eager["bytes"], (comp["bytes"], eager["bytes"])
    sizes = {(tuple(k["shape"]), k["dtype"]) for k in comp["kinds"]}
    assert any(int(__import__("numpy").prod(s)) == B * T * 4 * C for s, _ in sizes), sizes  # the MLP's wide tensor
    k = r["kernels"]
    assert "error" not in k, k
    assert k["by_kind"]["generated pointwise"]["kernels"] > 0 and k["by_kind"]["library"]["kernels"] > 0
