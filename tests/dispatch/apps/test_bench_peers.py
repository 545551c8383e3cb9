"""``bench --peers``: the flag parses (and refuses unknown peers), and a peer that cannot run here
(on the CPU: no CUDA device; on a GPU without gemlite installed: not importable) is a row with that
reason, never a crash or a failed bench. Where gemlite does run (a GPU with the `peers` extra), its
rows carry a time and an error figure beside ours. Nothing here is timed: on the CPU the bench runs
the interpreter on the tiny shape."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from dispatch.apps import bench, bench_peers


def _parser():
    import argparse

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p


def test_peers_flag_parses():
    assert _parser().parse_args(["--peers", "gemlite"]).peers == ["gemlite"]
    assert _parser().parse_args([]).peers is None
    with pytest.raises(SystemExit):
        _parser().parse_args(["--peers", "cutlass"])  # argparse exits 2 naming the allowed peers


def test_every_variant_has_a_gemlite_equivalent():
    from dispatch.registry import VARIANTS

    assert set(bench_peers.GEMLITE_FORMATS) == set(VARIANTS)


def test_peer_rows_report_why_or_run(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(["--shapes", "tiny", "--m", "1", "--formats", "fp8_tensor,mxfp4_w4a16", "--impls", "triton",
                     "--baselines", "torch_bf16", "--peers", "gemlite", "--no-progress", "--plain",
                     "--json", str(out)])
    assert rc == 0  # peers never fail the bench
    res = json.loads(out.read_text())
    rows = [r for r in res["results"] if r["kind"] == "peer"]
    assert sorted(r["variant"] for r in rows) == ["fp8_tensor", "mxfp4_w4a16"]
    info = res["peers"]["gemlite"]
    printed = capsys.readouterr().out
    if not torch.cuda.is_available() or importlib.util.find_spec("gemlite") is None:
        assert info["available"] is False
        want = "no CUDA device" if not torch.cuda.is_available() else "not importable"
        assert want in info["why"] and all(want in r["skipped"] and r["us"] is None for r in rows)
        assert "not run: " in printed
    else:
        assert info["available"] is True and "config" in info["config_note"]
        for r in rows:  # ran, or a row with the error (gemlite's NVFP4 does not compile on sm_90)
            assert (r.get("us") or 0) > 0 and r["err_vs_unquantized"] < 0.2 or r.get("error")
    ours = [r for r in res["results"] if r["kind"] == "impl" and r["mode"] == "linear"]
    # e2m1 weights carry ~10% quantization error of a normal weight (e4m3 ~4%); 0.2 catches a broken figure
    assert ours and all(0 < r["err_vs_unquantized"] < 0.2 for r in ours)
