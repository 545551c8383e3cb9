"""The b12x-dual command line: subcommand registry, --version, --help, info.

Modules: dispatch/apps/cli.py, dispatch/apps/info.py, dispatch/apps/argtypes.py.
"""

from __future__ import annotations

import os

import pytest

from dispatch import KNOWN_DEVICES, policy, registry
from dispatch.apps import cli


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for sub in ("info", "demo", "sweep"):
        assert sub in out


def test_version(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.startswith("b12x-dual ")


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 0
    assert "usage: b12x-dual" in capsys.readouterr().out


def test_info_shows_every_variant_for_a_described_device(capsys, monkeypatch):
    monkeypatch.delenv(policy.ENV_VAR, raising=False)
    assert cli.main(["info", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200 (sm_90, 132 SMs, 232448 B shared memory per block, 4800 GB/s)" in out
    for variant in registry.VARIANTS:
        assert variant in out
    assert "decode M=1" in out and "decode M=16" in out and "prefill M=4096" in out
    # sm_90's priority is hopper, triton, reference: auto picks hopper in every cell that has a
    # hopper backend (cute is not in the list), and every cell shows its route
    ok, why = registry.get("hopper", "fp8_tensor").is_supported(KNOWN_DEVICES["h200"])
    if not ok:
        pytest.skip(f"needs kernels_triton.hopper: {why}")
    with_hopper = [v for v in registry.VARIANTS
                   if not isinstance(registry.entries()[("hopper", v)], registry.UnsupportedEntry)]
    assert out.count(f"hopper: {why}"[:20]) == 3 * len(with_hopper)
    assert out.count("route: ") == 3 * len(registry.VARIANTS)
    assert "cute" not in out.split("auto's choice", 1)[1]


# ---------------------------------------------------------------------------------------------
# Option values and output paths are checked when the command line is parsed (argparse exits 2,
# naming the flag), so no kernel runs here and a bad path cannot lose a finished run's results.
# ---------------------------------------------------------------------------------------------
def _bad_values(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    d = str(tmp_path)
    return [
        (["bench", "--m", "abc"], "--m", "invalid int list 'abc' (expected comma-separated positive integers)"),
        (["bench", "--m", "16,0"], "--m", "invalid int list '16,0'"),
        (["bench", "--formats", "int4"], "--formats", "unknown format 'int4'"),
        (["bench", "--impls", "reference"], "--impls", "expected comma-separated names from triton, hopper, cute"),
        (["bench", "--baselines", "cublas"], "--baselines", "unknown baseline 'cublas'"),
        (["bench", "--shapes", "12xab"], "--shapes", "unknown shape '12xab'"),
        (["bench", "--budget-s", "-1"], "--budget-s", "expected a number >= 0"),
        (["bench", "--warmup-ms", "0"], "--warmup-ms", "expected a number > 0"),
        (["bench", "--rep-ms", "nan"], "--rep-ms", "expected a number > 0"),
        (["bench", "--graph-max-m", "x"], "--graph-max-m", "expected an integer >= 0"),
        (["bench", "--json", d], "--json", "it is a directory"),
        (["bench", "--plot", str(a_file / "p.png")], "--plot", "is a file, not a folder"),
        (["bench", "--summarize", str(tmp_path / "missing.json")], "--summarize", "no such file"),
        (["bench", "--sweep-json", d], "--sweep-json", "it is a directory"),
        (["sweep", "--m", "1.5"], "--m", "invalid int list '1.5'"),
        (["sweep", "--dtypes", "fp8"], "--dtypes", "unknown dtype 'fp8'"),
        (["sweep", "--impls", "cuda"], "--impls", "expected comma-separated names from reference, triton, hopper, cute"),
        (["sweep", "--formats", ""], "--formats", "invalid format list ''"),
        (["sweep", "--seed", "-3"], "--seed", "expected an integer >= 0"),
        (["sweep", "--json", d], "--json", "it is a directory"),
        (["demo", "--json", d], "--json", "it is a directory"),
        (["demo", "--plot", str(a_file / "sub" / "p.png")], "--plot", "is a file, not a folder"),
        (["demo", "--sentences", "1"], "--sentences", "expected an integer >= 2"),
        (["demo", "--batch-size", "0"], "--batch-size", "expected an integer > 0"),
        (["demo", "--device", "cuda:99"], "--device", "invalid torch device 'cuda:99'"),
        (["demo", "--device", "gpu0"], "--device", "invalid torch device 'gpu0'"),
        (["info", "-N", "0"], "-N", "expected an integer > 0"),
        (["info", "--device", "bogus"], "--device", "invalid device 'bogus'"),
    ]


def test_bad_values_exit_2_naming_the_flag(tmp_path, capsys):
    for argv, flag, message in _bad_values(tmp_path):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2, argv
        assert f"argument {flag}" in err and message in err, (argv, err)


def test_output_path_accepts_a_new_folder_and_rejects_what_cannot_be_written(tmp_path):
    from dispatch.apps import argtypes as A

    new = tmp_path / "not" / "yet" / "there.json"
    assert A.output_path(str(new)) == str(new) and not new.parent.exists()  # created only when written
    existing = tmp_path / "old.json"
    existing.write_text("{}")
    assert A.output_path(str(existing)) == str(existing)
    for bad in ("", str(tmp_path), str(existing / "below.json")):
        with pytest.raises(A.Invalid):
            A.output_path(bad)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be created")
def test_an_unwritable_json_path_fails_before_the_run(tmp_path, capsys):
    """os.access says yes to root everywhere; the path is tried (a file created and removed, an
    existing one opened for appending), so /proc fails at parse time, exit 2, naming the flag, and
    a good path is left as it was (no file created, an existing one's contents kept)."""
    from dispatch.apps import argtypes as A
    from dispatch.apps import sweep

    with pytest.raises(SystemExit) as e:
        sweep.main(["--json", "/proc/b12x-dual-sweep.json", "--formats", "fp8_tensor", "--m", "1", "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --json: invalid output path '/proc/b12x-dual-sweep.json' (cannot create files under '/proc'" in err
    with pytest.raises(A.Invalid, match="the file exists and is not writable"):
        A.output_path("/proc/version")
    existing = tmp_path / "old.json"
    existing.write_text("{}")
    assert A.output_path(str(existing)) == str(existing) and existing.read_text() == "{}"
    assert A.output_path(str(tmp_path / "new.json")) and list(tmp_path.iterdir()) == [existing]


def test_list_options_parse_to_lists():
    from dispatch.apps import argtypes as A

    assert A.int_list(" 1, 16,4096 ") == [1, 16, 4096]
    assert A.choice_list(("bf16", "fp16"), "dtype")("fp16,bf16") == ["fp16", "bf16"]
    assert A.positive_float("2.5") == 2.5 and A.nonnegative_int("0") == 0
