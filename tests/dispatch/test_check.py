"""The numerics watchdog (B12X_CHECK, dispatch.check) in QuantLinear, replay files (dispatch.replay)
and the bound of formats.bounds, on the CPU (Triton's interpreter).

Faults come from tests/faults.py: a real Triton backend with one defect, registered for the test.
Every expectation is the oracle's (formats.reference_linear) and the bound the kernel tests derive.
"""

from __future__ import annotations

import logging

import pytest
import torch

import formats
from conftest import gemm_bound as conftest_bound
from conftest import DEVICE, make_input
from dispatch import QuantLinear, check, registry, replay
from dispatch.apps import diff
from dispatch.backends import TritonBackend
from formats.bounds import gemm_bound

import faults

N, K, M = 160, 256, 4  # two column tiles (0-127, 128-159), 16 nvfp4 K-blocks


@pytest.fixture
def watchdog(monkeypatch, tmp_path):
    """watchdog(value) -> the Watchdog B12X_CHECK=value gives, replay files into tmp_path; off again after."""

    def on(value: str):
        monkeypatch.setenv(check.ENV_CHECK, value)
        monkeypatch.setenv(check.ENV_DIR, str(tmp_path))
        return check.reload()

    yield on
    monkeypatch.delenv(check.ENV_CHECK, raising=False)
    check.reload()
    assert check.WATCHDOG is None


def _layer(fmt="nvfp4", bias=True, name="model.layers.3.mlp.up_proj"):
    lin = torch.nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(make_input((N, K), torch.float32, block=16) * 0.05)
    q = QuantLinear.from_linear(lin.to(DEVICE), fmt, impl="triton")
    q.b12x_name = name
    return q


def test_bound_is_the_kernel_tests_bound():
    """formats.bounds.gemm_bound is the bound tests/conftest.py asserts (same inputs, same values)."""
    x = make_input((M, K), torch.bfloat16)
    w = formats.quantize(make_input((N, K), torch.float32) * 0.05, "mxfp8", role="weight")
    xq = formats.quantize(x, "mxfp8", role="activation")
    b = torch.randn(N, device=xq.device)
    ref = formats.reference_linear(xq, w, b, out_dtype=torch.bfloat16)
    for L in (0, 32):
        assert torch.equal(gemm_bound(xq, w, b, torch.bfloat16, ref, fp8_interval=L),
                           conftest_bound(xq, w, b, torch.bfloat16, ref, fp8_interval=L))
    with pytest.raises(ValueError, match="out_dtype"):
        gemm_bound(xq, w, b, torch.float64, ref)


@pytest.mark.parametrize("value,want", [("", None), ("0", None), ("off", None), ("0.01", check.Sampling(rate=0.01)),
                                        ("1", check.Sampling(rate=1.0)), ("every:100", check.Sampling(every=100))])
def test_parse_sampling(value, want):
    assert check.parse_sampling(value) == want


@pytest.mark.parametrize("value", ["2", "-0.1", "nan", "every:0", "every:x", "sometimes"])
def test_bad_b12x_check_is_named(value, watchdog):
    with pytest.raises(ValueError, match=r"B12X_CHECK=.*allowed: a probability in \(0, 1\]"):
        check.parse_sampling(value)
    watchdog(value)  # a bad value raises on the first call, naming the variable
    with pytest.raises(ValueError, match="B12X_CHECK"):
        _layer()(make_input((M, K)))


def test_off_never_calls_the_checker(monkeypatch):
    """B12X_CHECK unset: WATCHDOG is None and a forward never enters dispatch.check's checks."""
    monkeypatch.delenv(check.ENV_CHECK, raising=False)
    assert check.reload() is None

    def boom(*a, **k):
        raise AssertionError("the checker was called with B12X_CHECK off")

    for name in ("check_call", "compare_backend", "quant_diff", "error_grid", "layer_name"):
        monkeypatch.setattr(check, name, boom)
    monkeypatch.setattr(check.Watchdog, "after_call", boom)
    q = _layer()
    x = make_input((M, K))
    y = q(x)
    ref = formats.reference_linear(x, q.qweight, q.bias)
    assert torch.isfinite(y).all() and (y.double() - ref.double()).abs().max() < 1  # a real result


def test_clean_layer_passes_and_sampling_counts(watchdog):
    wd = watchdog("every:3")
    q = _layer()
    for _ in range(5):
        q(make_input((M, K)))
    assert wd.checked == 2 and not wd.diverged  # calls 1 and 4 of the layer
    wd = watchdog("0.5")
    for _ in range(10):
        q(make_input((1, K)))
    assert 1 <= wd.checked <= 9 and not wd.diverged  # seeded draws (B12X_CHECK_SEED=0)


def test_watchdog_finds_flipped_weight_scale_and_replays(watchdog, caplog, tmp_path):
    """A flipped block-scale byte (row 130, K-block 1) in triton's prepared weight: one WARNING naming
    the layer, the implementation, the first bad block (row 0, column tile 1 = columns 128-255, stage
    gemm); a replay file that reproduces it on this CPU while the fault is present, and whose recorded
    output departs from the oracle in the same block after it is gone."""
    wd = watchdog("1")
    q = _layer()
    x = make_input((M, K))
    with faults.installed(faults.FlippedWeightScale, "nvfp4"), caplog.at_level(logging.WARNING, "dispatch.check"):
        q(x)
        q(x)  # a layer is reported once
        warnings = [r for r in caplog.records if "watchdog" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        msg = warnings[0].getMessage()
        assert "model.layers.3.mlp.up_proj" in msg and "triton" in msg and "nvfp4" in msg
        assert "gemm departs first: row 0, column tile 1" in msg
        rep = wd.diverged["model.layers.3.mlp.up_proj"]
        assert rep["first"]["stage"] == "gemm" and rep["first"]["tile"] == 1 and rep["activation"]["equal"]
        files = list(tmp_path.glob("*" + replay.SUFFIX))
        assert len(files) == 1 and str(files[0]) == rep["replay"]
        again = diff.run_replay(str(files[0]), device=DEVICE)
        assert again["replay"]["reproduces"] is True
        assert again["first"]["impl"] == "triton" and again["first"]["stage"] == "gemm" and again["first"]["tile"] == 1
    rp = replay.read(files[0])
    assert rp.layer == "model.layers.3.mlp.up_proj" and rp.impl == "triton" and rp.variant == "nvfp4"
    assert torch.equal(rp.x.cpu(), x.cpu()) and rp.meta["versions"]["torch"] == torch.__version__
    assert torch.equal(rp.qweight.scale.view(torch.uint8).cpu(), q.qweight.scale.view(torch.uint8).cpu())  # the true weight
    clean = diff.run_replay(str(files[0]), device=DEVICE)
    assert clean["replay"]["reproduces"] is False and clean["ok"]
    rec = clean["replay"]["recorded_output"]
    assert not rec["ok"] and rec["first"]["row"] == 0 and rec["first"]["tile"] == 1


def test_watchdog_names_the_activation_stage(watchdog):
    """A flipped activation scale byte (row 2, K-block 1): the activation departs first, at that block."""
    wd = watchdog("every:1")
    q = _layer()
    with faults.installed(faults.FlippedActivationScale, "nvfp4"):
        q(make_input((M, K)))
    rep = wd.diverged["model.layers.3.mlp.up_proj"]
    assert rep["first"] == {"stage": "activation", "row": 2, "kblock": 1, "what": "scale"}
    assert rep["activation"]["scale_blocks"] == [[2, 1]] and rep["activation"]["n_code_bytes"] == 0


def test_watchdog_w4a16_and_fp8_block_rows(watchdog):
    """A wrong output row on fp8_block (gemm stage) and a clean W4A16 layer (linear stage)."""
    wd = watchdog("1")
    q = _layer("fp8_block", name="blk")
    with faults.installed(faults.ScaledRow, "fp8_block"):
        q(make_input((5, K)))
    assert wd.diverged["blk"]["first"]["stage"] == "gemm" and wd.diverged["blk"]["first"]["row"] == 3
    a16 = _layer("nvfp4_w4a16", name="a16")
    a16(make_input((3, K)))
    assert "a16" not in wd.diverged and wd.checked == 2


def test_replay_file_errors(tmp_path):
    """Another kind of safetensors file, a newer file version, a missing file: ValueError naming it."""
    from safetensors.torch import save_file

    from dispatch import save_quantized

    m = torch.nn.Sequential(_layer())
    own = tmp_path / "model.safetensors"
    save_quantized(m, own)
    with pytest.raises(ValueError, match="not a b12x-dual replay file"):
        replay.read(own)
    x = make_input((M, K))
    q = m[0].qweight
    path = replay.write(tmp_path, layer="l", impl="triton", variant="nvfp4", x=x, qweight=q)
    assert replay.read(path).variant == "nvfp4"
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        md, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    newer = tmp_path / "newer.safetensors"
    save_file(tensors, str(newer), metadata={**md, "version": str(replay.VERSION + 1)})
    with pytest.raises(ValueError, match=f"file version {replay.VERSION + 1} is newer"):
        replay.read(newer)
    other = tmp_path / "other.safetensors"
    md2 = dict(md)
    md2["meta"] = md["meta"].replace('"variant": "nvfp4"', '"variant": "mxfp4"')
    save_file(tensors, str(other), metadata=md2)
    with pytest.raises(ValueError, match="variant 'mxfp4' but a 'nvfp4' weight"):
        replay.read(other)
    with pytest.raises(ValueError, match="no such file"):
        replay.read(tmp_path / "absent.safetensors")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA device; CPU only here")
def test_capture_is_not_checked(watchdog, caplog):
    """Inside CUDA-graph capture the watchdog checks nothing (logged once); the eager calls are checked."""
    wd = watchdog("1")
    q = _layer().cuda()
    x = make_input((M, K)).cuda()
    q(x)  # warmup (compiles), checked
    assert wd.checked == 1
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with caplog.at_level(logging.INFO, "dispatch.check"), torch.cuda.graph(g):
        y = q(x)
    g.replay()
    torch.cuda.synchronize()
    assert wd.checked == 1
    assert sum("CUDA-graph capture" in r.getMessage() for r in caplog.records) == 1
    ref = formats.reference_linear(x, q.qweight, q.bias)
    assert (y.double() - ref.double()).abs().max().item() < 1


def test_route_is_the_backends_route_with_the_calls_options():
    """route_of: Backend.route(problem, device, **act_opts).describe(); a static nvfp4 global scale
    drops the amax kernel from the route; a route that raises is reported, not raised."""
    from dispatch.devices import CPU

    b = TritonBackend("nvfp4")
    dynamic = check.route_of(b, 4, N, K, torch.bfloat16, CPU)
    assert dynamic == b.route(registry.Problem("nvfp4", 4, N, K), CPU).describe()
    assert "_amax_partials_kernel" in dynamic and "_portable_gemm_kernel" in dynamic
    static = check.route_of(b, 4, N, K, torch.bfloat16, CPU, {"global_scale": 100.0})
    assert "_amax_partials_kernel" not in static and "_portable_gemm_kernel" in static

    class Broken(TritonBackend):
        def route(self, problem, device, **opts):
            raise RuntimeError("no route")

    assert check.route_of(Broken("nvfp4"), 4, N, K, torch.bfloat16, CPU) == "(route unavailable: RuntimeError: no route)"


def test_a_check_that_fails_is_logged_not_raised(watchdog, caplog, monkeypatch):
    """An exception inside the check (here: the quantizer raising) is logged once; the call's own
    result is returned and the layer is not checked again."""
    wd = watchdog("1")
    q = _layer()
    x = make_input((M, K))

    def broken(*a, **k):
        raise RuntimeError("quantizer exploded")

    with faults.installed(faults.FlippedWeightScale, "nvfp4", only_n=-1) as b:
        monkeypatch.setattr(b, "quantize_activation", broken)
        with caplog.at_level(logging.ERROR, "dispatch.check"):
            y1, y2 = q(x), q(x)
    assert torch.equal(y1, y2) and wd.checked == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "quantizer exploded" in errors[0] and "model.layers.3.mlp.up_proj" in errors[0]
