"""The numerics watchdog (B12X_CHECK, dispatch.check) in QuantLinear, replay files (dispatch.replay)
and the bound of formats.bounds, on the CPU (Triton's interpreter).

Faults come from tests/faults.py: a real Triton backend with one defect, registered for the test.
Every expectation is the oracle's (formats.reference_linear) and the bound the kernel tests derive.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

import formats
from conftest import gemm_bound as conftest_bound
from conftest import DEVICE, make_input
from dispatch import QuantLinear, check, registry, replay
from dispatch.apps import diff
from dispatch.apps.cli import main
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
    assert wd.clean == {"model.layers.3.mlp.up_proj": 2}
    assert wd.summary() == "b12x-dual watchdog: 2 checks; 1 layer(s) clean; none diverged"
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
    assert rep["first"] == {"stage": "activation", "row": 2, "kblock": 1, "what": "scale", "columns": [16, 31]}
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
    assert wd.clean == {"a16": 1}  # the diverged layer is not counted clean
    assert wd.summary() == "b12x-dual watchdog: 2 checks; 1 layer(s) clean; diverged or not checkable: blk"


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


# ---------------------------------------------------------------------------------------------
# The non-finite agreement table, cell by cell
# ---------------------------------------------------------------------------------------------
_VALUES = {"finite": 3.0, "nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@pytest.mark.parametrize("y_kind", list(_VALUES))
@pytest.mark.parametrize("ref_kind", list(_VALUES))
def test_nonfinite_agreement_table(y_kind, ref_kind):
    """error_grid per cell: both finite -> |y - ref| / bound; y non-finite where the oracle is finite,
    or y finite where the oracle is not -> inf (NaN never passes, nor becomes finite); both non-finite
    -> 0 (a NaN or Inf output agrees with a NaN or Inf oracle: fp32 and float64 overflow differently,
    so the kind and sign are not compared). The cell sits at row 1, column 200 (tile 1); every other
    element is equal, so the grid's only non-zero block and the first bad block are (1, 1) or none."""
    M, N = 3, 256
    ref = torch.linspace(-2, 2, M * N, dtype=torch.float64).reshape(M, N)
    y = ref.clone()
    bound = torch.full((M, N), 0.5, dtype=torch.float64)
    ref[1, 200] = _VALUES[ref_kind]
    y[1, 200] = _VALUES[y_kind] if y_kind != "finite" else (ref[1, 200] + 0.125 if ref_kind == "finite" else 3.0)
    grid = check.error_grid(y, ref, bound)
    s = check.grid_summary(grid)
    yf, rf = y_kind == "finite", ref_kind == "finite"
    want = 0.125 / 0.5 if (yf and rf) else (0.0 if (not yf and not rf) else math.inf)
    assert grid.shape == (3, 2) and grid[1, 1].item() == want
    assert torch.count_nonzero(grid).item() == (1 if want else 0)
    assert s["first"] == ({"row": 1, "tile": 1} if want > 1 else None)
    assert s["n_bad"] == (1 if want > 1 else 0) and s["worst"] == want


# ---------------------------------------------------------------------------------------------
# The sampling schedule, call by call
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_n_checks_the_first_call_and_every_nth_after_per_layer(n):
    """every:N: call i (0-based) of a layer is checked when i % N == 0, counted per layer (two
    interleaved layers keep their own counters); a layer that diverged is never checked again."""
    wd = check.Watchdog(check.Sampling(every=n))
    got_a, got_b = [], []
    for _ in range(7):
        got_a.append(wd.sample("a"))
        got_b.append(wd.sample("b"))
        got_b.append(wd.sample("b"))
    assert got_a == [i % n == 0 for i in range(7)]
    assert got_b == [i % n == 0 for i in range(14)]
    wd.diverged["a"] = {"ok": False}
    assert not any(wd.sample("a") for _ in range(2 * n))


def test_rate_sampling_follows_the_seeded_generator():
    """A rate p: call k is checked when the k-th draw of random.Random(B12X_CHECK_SEED) is below p
    (one stream for all layers, so the checked calls are reproducible from the seed)."""
    import random

    for seed, p in ((0, 0.3), (7, 0.5)):
        wd = check.Watchdog(check.Sampling(rate=p), seed=seed)
        rng = random.Random(seed)
        layers = ["a", "b", "c"] * 40
        got = [wd.sample(layer) for layer in layers]
        assert got == [rng.random() < p for _ in layers]
        assert 0 < sum(got) < len(got)


# ---------------------------------------------------------------------------------------------
# Replay files: every field round trips; a version-1 file is still read
# ---------------------------------------------------------------------------------------------
V1_FILE = Path(__file__).parent / "data" / "replay_v1_nvfp4.b12x-replay.safetensors"


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).reshape(-1)


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("variant,opts", [
    ("nvfp4", {"global_scale": torch.tensor(448.0 * 6 / 5.0)}),
    ("fp8_tensor", {"scale": torch.tensor(5.0 / 448)}),
    ("mxfp8", {"scale_rule": "floor"}),
    ("fp8_block", {"ue8m0": True}),
], ids=["nvfp4-tensor-option", "fp8_tensor-tensor-option", "mxfp8-str-option", "fp8_block-bool-option"])
def test_replay_round_trip_field_by_field(tmp_path, variant, opts):
    """replay.write then replay.read: x (dtype, shape, strides, storage offset, the bytes between its
    rows), y, the weight (each tensor and its metadata), bias, every option (tensors and plain
    values), route, the recorded report and the implementation's quantized activation come back as
    written; rebuild_x gives the call's layout back."""
    fmt = registry.variant(variant).fmt
    wide = make_input((5, 3 * K), torch.bfloat16, device="cpu")
    x = wide[:, K:2 * K]  # a column slice: row stride 3K, storage offset K
    q = formats.quantize(make_input((N, K), torch.float32, device="cpu") * 0.05, fmt, role="weight")
    bias = torch.randn(N).to(torch.bfloat16)
    xq = formats.quantize(x, fmt, role="activation", **opts)
    y = formats.reference_linear(xq, q, bias)
    report = {"first": {"stage": "gemm", "row": 0, "tile": 1, "ratio": 2.5}, "ok": False}
    path = replay.write(tmp_path, layer="model.layers.0.mlp.up_proj", impl="triton", variant=variant, x=x, qweight=q,
                        bias=bias, act_opts=opts, y=y, route="triton: _quantize_kernel -> _gemm_kernel", report=report,
                        xq=xq)
    rp = replay.read(path)
    assert (rp.layer, rp.impl, rp.variant, rp.version) == ("model.layers.0.mlp.up_proj", "triton", variant,
                                                           replay.VERSION)
    assert _same(rp.x, x.contiguous()) and _same(rp.y, y) and _same(rp.bias, bias)
    for name in ("data", "scale", "global_scale"):
        a, b = getattr(rp.qweight, name), getattr(q, name)
        assert (a is None and b is None) or _same(a, b), name
        a, b = getattr(rp.xq, name), getattr(xq, name)
        assert (a is None and b is None) or _same(a, b), name
    for field in ("fmt", "role", "block_shape", "shape", "scale_layout"):
        assert getattr(rp.qweight, field) == getattr(q, field) and getattr(rp.xq, field) == getattr(xq, field)
    assert set(rp.act_opts) == set(opts)
    for k, v in opts.items():
        assert _same(rp.act_opts[k].reshape(()), v.reshape(())) if isinstance(v, torch.Tensor) else rp.act_opts[k] == v
    assert rp.meta["route"] == "triton: _quantize_kernel -> _gemm_kernel" and rp.meta["report"] == report
    assert rp.layout["shape"] == [5, K] and rp.layout["stride"] == [3 * K, 1] and not rp.layout["contiguous"]
    assert rp.layout["span"] == 4 * 3 * K + K and _same(rp.storage, wide.reshape(-1)[K:K + 4 * 3 * K + K])
    again, how = replay.rebuild_x(rp, "cpu")
    assert again.stride() == x.stride() and again.shape == x.shape and _same(again.contiguous(), x.contiguous())
    assert again.data_ptr() % replay.ALIGN == x.data_ptr() % replay.ALIGN
    assert how.startswith("input layout rebuilt: shape (5, 256), strides (768, 1)")
    # the bytes between the rows are the call's neighbours, not a fresh fill
    assert _same(torch.as_strided(again, (rp.layout["span"],), (1,)), rp.storage)


def test_a_version_1_file_is_read_and_replayed(capsys):
    """A file written by the version-1 code (tests/dispatch/data/README.md): every field is read; the
    replay says that the input layout differs (none recorded) and that the stage is not rechecked; the
    recorded output departs where the watchdog said (row 0, tile 0); with the fault back, it reproduces."""
    rp = replay.read(V1_FILE)
    assert (rp.version, rp.layer, rp.impl, rp.variant) == (1, "model.layers.0.self_attn.o_proj", "triton", "nvfp4")
    assert rp.layout is None and rp.storage is None and rp.xq is None
    assert rp.x.shape == (3, 64) and rp.x.dtype == torch.bfloat16 and rp.y.shape == (3, 32) and rp.bias.shape == (32,)
    assert rp.qweight.shape == (32, 64) and rp.qweight.global_scale is not None
    assert rp.act_opts["global_scale"].item() == pytest.approx(448.0 * 6 / 4.0)
    assert rp.meta["report"]["first"]["stage"] == "gemm" and rp.meta["report"]["first"]["tile"] == 0
    x, how = replay.rebuild_x(rp, "cpu")
    assert x.is_contiguous() and how.startswith("input layout differs: the file (version 1)")
    res = diff.run_replay(str(V1_FILE), device=DEVICE)
    info = res["replay"]
    assert info["version"] == 1 and not info["layout_rebuilt"] and not info["stage_rechecked"]
    assert info["recorded_output"]["first"]["stage"] == "gemm" and info["recorded_output"]["first"]["tile"] == 0
    assert info["reproduces"] is False and res["exit"] == diff.EXIT_OK
    diff.print_report(res, plain=True)
    out = capsys.readouterr().out
    assert "input layout differs" in out and "recorded by the watchdog: gemm departs first: row 0" in out
    assert "the file holds no quantized activation of the implementation (version 1)" in out
    with faults.installed(faults.FlippedWeightScale, "nvfp4", n=5, kb=1):
        assert diff.run_replay(str(V1_FILE), device=DEVICE)["replay"]["reproduces"] is True


# ---------------------------------------------------------------------------------------------
# The watchdog's message; a replay keeps the layout and the stage of the call
# ---------------------------------------------------------------------------------------------
def test_watchdog_warning_is_a_short_first_line_then_details(watchdog, caplog):
    wd = watchdog("1")
    q = _layer()
    with faults.installed(faults.FlippedWeightScale, "nvfp4"), caplog.at_level(logging.WARNING, "dispatch.check"):
        q(make_input((M, K)))
    (msg,) = [r.getMessage() for r in caplog.records if "watchdog" in r.getMessage()]
    first, *rest = msg.splitlines()
    ratio = wd.diverged["model.layers.3.mlp.up_proj"]["first"]["ratio"]
    assert first == ("b12x-dual watchdog: layer model.layers.3.mlp.up_proj on triton (nvfp4, M=4): gemm departs "
                     f"first: row 0, column tile 1 (columns 128-255), {ratio:.3g}x the bound")
    assert len(first) < 160
    assert [line.split(":")[0] for line in rest] == ["  route", "  bound", "  replay file", "  rerun it anywhere"]


def test_stride_dependent_fault_is_caught_and_its_replay_reproduces_it(watchdog, tmp_path, capsys):
    """A quantizer that ignores x's row stride (tests/faults.py IgnoresRowStride), fed a column slice of
    a wider tensor: the watchdog names the activation stage at row 1, K-block 0 (columns 0-31); the
    replay file rebuilds that layout, so `diff --replay` on the faulty build reproduces it (exit 1);
    the same file without its layout (as a version-1 file) reruns on a contiguous copy, where the
    fault does not show, and says the layout differs."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    wd = watchdog("1")
    q = _layer("mxfp8", name="model.layers.5.self_attn.o_proj")
    wide = make_input((6, 2 * K), device=DEVICE)
    with faults.installed(faults.IgnoresRowStride, "mxfp8"):
        q(wide[:, :K].contiguous())  # a packed x: no fault
        assert not wd.diverged
        q(wide[:, K:])
        rep = wd.diverged["model.layers.5.self_attn.o_proj"]
        assert rep["first"] == {"stage": "activation", "what": "codes", "row": 1, "kblock": 0, "columns": [0, 31]}
        rc = main(["diff", "--replay", rep["replay"], "--plain", "--no-progress", "--device", DEVICE])
        out = capsys.readouterr().out
        assert rc == diff.EXIT_DEPARTS
        assert "input layout rebuilt: shape (6, 256), strides (512, 1)" in out
        assert "reproduces here: YES" in out
        assert ("recorded by the watchdog: activation quantization departs first: codes of row 1, K-block 0 "
                "(columns 0-31)") in out
        assert "first bad block: layer model.layers.5.self_attn.o_proj (M=6), triton: activation quantization " \
               "departs first: codes of row 1, K-block 0 (columns 0-31)" in out
        with safe_open(rep["replay"], "pt") as f:
            md, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys() if not k.startswith(("x.", "xq."))}
        old = tmp_path / "as-v1.b12x-replay.safetensors"
        save_file(tensors, str(old), metadata={**md, "version": "1"})
        again = diff.run_replay(str(old), device=DEVICE)
        assert again["replay"]["reproduces"] is False and again["replay"]["layout"].startswith("input layout differs")


def test_replay_rechecks_the_activation_stage_it_recorded(watchdog):
    """A flipped activation block-scale byte: the file holds the implementation's quantized
    activation, so on a clean machine the recorded output is still reported at the activation stage
    (row 2, K-block 1, columns 16-31), not as a gemm departure."""
    wd = watchdog("1")
    q = _layer()
    with faults.installed(faults.FlippedActivationScale, "nvfp4"):
        q(make_input((M, K)))
    rep = wd.diverged["model.layers.3.mlp.up_proj"]
    res = diff.run_replay(rep["replay"], device=DEVICE)
    rec = res["replay"]["recorded_output"]
    assert res["replay"]["stage_rechecked"] and res["replay"]["reproduces"] is False
    assert rec["first"] == {"stage": "activation", "what": "scale", "row": 2, "kblock": 1, "columns": [16, 31]}
    assert res["replay"]["recorded_report"]["first"] == rec["first"]
