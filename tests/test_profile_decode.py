"""benchmarks/profile_decode.py and benchmarks/device_trace.py: kernel kinds from names, model parts from the
decode program's HLO metadata (synthetic GPU trace), and a real CPU run on `tiny` end to end."""
import json

import pytest

from benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def dt():
    return load_benchmark("device_trace.py", "device_trace")


@pytest.fixture(scope="module")
def pd(dt):
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))   # e2e_decode's imports
    try:
        return load_benchmark("profile_decode.py", "profile_decode")
    finally:
        sys.path.pop(0)


@pytest.mark.parametrize("name, kind", [
    ("body_mosaic_gpu_kernel", "attention kernel (Pallas)"),
    ("decode_matmul_mosaic_gpu_kernel", "matmul"),           # the projections' Pallas GEMM
    ("decode_matmul_2048x8192_mosaic_gpu_kernel", "matmul"),  # ... named by its shape
    ("decode_gated_matmul_8192x2048_mosaic_gpu_kernel", "matmul"),
    ("rope_kv_write_mosaic_gpu_kernel", "KV write (scatter)"),  # q/k/v's sum, RoPE and the KV write in one kernel
    ("residual_rmsnorm_mosaic_gpu_kernel", "reductions (norms, sampling)"),  # the residual add and its norm
    ("nvjet_sm90_tss_112x64_64x9_2x1_v_bz_TNN", "matmul"),
    ("gemm_fusion_dot_general_564", "matmul"),
    ("input_scatter_fusion_31", "KV write (scatter)"),
    ("wrapped_concatenate_1", "concatenate / copy"),
    ("input_reduce_fusion", "reductions (norms, sampling)"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
    ("loop_add_fusion_1", "other fusions (RoPE, residual, activation)"),
])
def test_kernel_kinds_from_names(dt, name, kind):
    assert dt.kernel_kind(name) == kind


HLO = """
  %gemm_fusion_dot.1 = bf16[64,16384]{1,0} fusion(%a, %b), kind=kCustom, metadata={op_name="jit(decode_steps)/while/body/forward/Decoder/layers_0/mlp/gate_proj/...i,oi->...o/dot_general" stack_frame_id=3}
  ROOT %custom-call.7 = bf16[64,2048]{1,0} custom-call(%x), metadata={op_name="jit(decode_steps)/while/body/forward/Decoder/layers_0/self_attn/attention/pallas_call"}
  %gemm_fusion_dot_general.564 = f32[64,128256]{1,0} fusion(%h, %e), kind=kCustom, metadata={op_name="jit(decode_steps)/while/body/lm_head/Decoder.logits/dot_general"}
"""
META = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]


def _trace():
    events = list(META)
    for start in (1000, 2000):       # two annotated decode calls of 4 steps each
        events += [{"ph": "X", "pid": 2, "name": "e2e_decode_call", "ts": start, "dur": 500},
                   {"ph": "X", "pid": 1, "name": "gemm_fusion_dot_1", "ts": start + 10, "dur": 100},
                   {"ph": "X", "pid": 1, "name": "body_mosaic_gpu_kernel", "ts": start + 110, "dur": 60,
                    "args": {"hlo_op": "custom-call.7"}},
                   {"ph": "X", "pid": 1, "name": "nvjet_sm90_tst_128x160", "ts": start + 170, "dur": 40,
                    "args": {"hlo_op": "gemm_fusion_dot_general.564"}},
                   {"ph": "X", "pid": 1, "name": "loop_add_fusion", "ts": start + 210, "dur": 8}]
    events.append({"ph": "X", "pid": 1, "name": "prefill_fusion", "ts": 0, "dur": 900})   # outside: not counted
    return events


WINDOW = {"annotation": "e2e_decode_call",
          "calls": [{"kind": "decode", "steps": 4, "seconds": 0.001, "mean_context": 100.0}] * 2}


def test_parts_come_from_hlo_metadata_through_hlo_op_or_the_kernel_name(pd):
    got = pd.analyse(_trace(), WINDOW, HLO)
    assert got["steps"] == 8 and got["mean_context"] == 100.0
    ms = 2 / 8 / 1000                  # two calls' worth of each kernel, per step, in ms per µs
    assert got["by_part_ms"]["MLP gate/up"] == pytest.approx(100 * ms)        # by name: gemm_fusion_dot_1
    assert got["by_part_ms"]["attention"] == pytest.approx(60 * ms)           # by hlo_op: custom-call.7
    assert got["by_part_ms"]["LM head"] == pytest.approx(40 * ms)             # a cuBLAS kernel, by hlo_op
    assert got["by_part_ms"]["other / unattributed"] == pytest.approx(8 * ms)
    assert got["by_kind_ms"]["matmul"] == pytest.approx(140 * ms)
    assert got["busy_ms"] == pytest.approx(208 * ms)
    top = {t["name"]: t for t in got["top_kernels"]}
    assert top["gemm_fusion_dot_1"]["launches_per_step"] == pytest.approx(0.25)


def test_handoffs_are_the_gaps_between_consecutive_kernels_by_part(pd):
    """Each kernel's next start minus its end, per pair of model parts; an overlap (a dependent launched early) is
    negative."""
    got = pd.analyse(_trace(), WINDOW, HLO)["handoffs_us"]
    assert got["MLP gate/up -> attention"] == {"mean_us": 0.0, "count": 2}
    assert got["LM head -> other / unattributed"] == {"mean_us": 0.0, "count": 2}
    assert "other / unattributed -> MLP gate/up" not in got      # the last kernel of call 1 and the first of call 2
    events = _trace()
    events[4] = {**events[4], "ts": events[4]["ts"] - 5}       # attention starts 5 us before the GEMM ends
    got = pd.analyse(events, WINDOW, HLO)["handoffs_us"]
    assert got["MLP gate/up -> attention"] == {"mean_us": -2.5, "count": 2}    # one of the two calls moved
    assert list(got)[0] in ("MLP gate/up -> attention", "attention -> LM head", "LM head -> other / unattributed")


def test_a_library_gemm_without_hlo_op_is_matched_by_its_launches_per_step(pd):
    hlo = HLO + "\n".join(
        f'  %custom-call.{20 + i} = bf16[64,4096]{{1,0}} custom-call(%x), custom_call_target="__cublas$lt$matmul", '
        f'metadata={{op_name="jit(decode_steps)/while/body/forward/Decoder/layers_{i}/mlp/down_proj/dot_general"}}'
        for i in range(2)) + '\n  %custom-call.30 = f32[64,128256]{1,0} custom-call(%h), custom_call_target="__cublas$gemm", ' \
        'metadata={op_name="jit(decode_steps)/while/body/lm_head/Decoder.logits/dot_general"}'
    events = list(META) + [{"ph": "X", "pid": 2, "name": "e2e_decode_call", "ts": 0, "dur": 1000}]
    events += [{"ph": "X", "pid": 1, "name": "nvjet_sm90_tss_128x64", "ts": 10 + 100 * i, "dur": 50} for i in range(2)]
    events += [{"ph": "X", "pid": 1, "name": "nvjet_sm90_tst_144x64", "ts": 300, "dur": 70},
               {"ph": "X", "pid": 1, "name": "body_mosaic_gpu_kernel", "ts": 400, "dur": 30}]
    got = pd.analyse(events, {"annotation": "e2e_decode_call", "calls": [{"kind": "decode", "steps": 1, "seconds": 0.001}]},
                     hlo)
    assert got["by_part_ms"]["MLP down"] == pytest.approx(0.1)     # 2 launches: the part with 2 cuBLAS calls
    assert got["by_part_ms"]["LM head"] == pytest.approx(0.07)     # 1 launch: the part with 1
    assert got["by_part_ms"]["attention"] == pytest.approx(0.03)   # the Pallas kernel, by its kind
    assert got["attributed_share"] == pytest.approx(1.0)


def _mosaic_call(n, symbol, op_name):
    """An HLO line of a Pallas Mosaic GPU custom call as XLA prints it: the serialized module (escaped bytes) after
    the metadata, with the kernel's symbol and the `stable_mosaic_gpu` dialect name in it."""
    return (f'  %mpmd_map.{n} = f32[4,64,2048]{{2,1,0}} custom-call(%x, %w), custom_call_target="mosaic_gpu_v2", '
            f'metadata={{op_name="jit(decode_steps)/while/body/forward/Decoder/{op_name}/mpmd_map"}}, '
            f'backend_config={{module = "ML\\EFR\\01builtin\\00stable_mosaic_gpu\\00llvm\\00'
            f'emit_c_interface\\00{symbol}_mosaic_gpu\\00ordering\\00"}}')


def test_pallas_kernels_are_attributed_through_the_symbol_in_their_custom_call(pd):
    """The projections' Pallas GEMMs name their shape, so each maps to its part through its custom call's module;
    a kernel name whose calls span two parts stays unattributed rather than guessed."""
    hlo = "\n".join([
        _mosaic_call(1, "decode_matmul_2048x2048", "layers_0/self_attn/o_proj/jit(_decode_matmul)/decode_matmul"),
        _mosaic_call(2, "decode_matmul_2048x2048", "layers_1/self_attn/o_proj/jit(_decode_matmul)/decode_matmul"),
        _mosaic_call(3, "decode_gated_matmul_8192x2048", "layers_0/mlp/gate_up_proj/jit(_decode_matmul)/x"),
        _mosaic_call(4, "decode_matmul_3072x2048", "layers_0/self_attn/qkv_proj/jit(_decode_matmul)/x"),
        _mosaic_call(5, "decode_matmul_3072x2048", "layers_0/mlp/down_proj/jit(_decode_matmul)/x")])
    assert pd.mosaic_kernel_ops(hlo).keys() == {"decode_matmul_2048x2048_mosaic_gpu_kernel",
                                                "decode_gated_matmul_8192x2048_mosaic_gpu_kernel"}
    events = list(META) + [{"ph": "X", "pid": 2, "name": "e2e_decode_call", "ts": 0, "dur": 1000}]
    for i, (name, dur) in enumerate([("decode_matmul_2048x2048", 5), ("decode_gated_matmul_8192x2048", 20),
                                     ("decode_matmul_3072x2048", 7), ("decode_matmul_2048x2048", 5)]):
        events.append({"ph": "X", "pid": 1, "name": f"{name}_mosaic_gpu_kernel", "ts": 10 + 50 * i, "dur": dur})
    window = {"annotation": "e2e_decode_call", "calls": [{"kind": "decode", "steps": 1, "seconds": 0.001}]}
    got = pd.analyse(events, window, hlo)
    assert got["by_part_ms"]["o projection"] == pytest.approx(0.010)
    assert got["by_part_ms"]["MLP gate/up"] == pytest.approx(0.020)
    assert got["by_part_ms"]["other / unattributed"] == pytest.approx(0.007)       # qkv and down share a name here


def test_a_window_of_other_calls_is_refused(pd):
    with pytest.raises(ValueError, match="not all decode calls"):
        pd.analyse(_trace(), {**WINDOW, "calls": [{**WINDOW["calls"][0], "kind": "mixed"}] * 2}, HLO)
    with pytest.raises(ValueError, match="2 'e2e_decode_call' annotations"):
        pd.analyse(_trace(), {**WINDOW, "calls": WINDOW["calls"][:1]}, HLO)


def test_a_cpu_run_on_tiny_writes_the_table_and_a_trace(pd, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert pd.main(["--model", "tiny", "--batch", "2", "--prompt-len", "16", "--new-tokens", "40",
                    "--decode-steps", "4", "--copy-gb", "0.01", "--calls", "3", "--device", "/host:CPU",
                    "--trace-dir", str(tmp_path / "trace"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    prof = result["profile"]
    assert prof["steps"] == 12 and prof["calls"] == 3
    # The XLA CPU ops are attributed through the HLO: the LM head, the projections and the MLP all show. The
    # check counts launches (0.69 on tiny, fixed by the program): the share of kernel *time* moves with the CPU's
    # load (0.47 to 0.82 seen), so a threshold on it was luck.
    assert prof["attributed_launch_share"] > 0.5 and 0 < prof["attributed_share"] <= 1
    for part in ("LM head", "q/k/v projections", "MLP gate/up", "MLP down"):
        assert prof["by_part_ms"][part] > 0
    assert result["bytes_per_step"] > 0 and result["byte_floor_ms"] > 0
    assert list((tmp_path / "trace").rglob("*.xplane.pb"))          # what TensorBoard / XProf open
    assert "by model part" in capsys.readouterr().out
