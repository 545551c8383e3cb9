"""The b12x-dual command line: subcommand registry, --version, --help, info."""

from __future__ import annotations

import pytest

from dispatch import policy
from dispatch.apps import cli


def test_every_registered_subcommand_has_add_parser_and_run():
    import importlib

    for name in cli.SUBCOMMANDS:
        mod = importlib.import_module(name)
        assert callable(mod.add_parser) and callable(mod.run), name


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
    for variant in policy.VARIANTS:
        assert variant in out
    assert "decode M=1" in out and "decode M=16" in out and "prefill M=4096" in out
    assert out.count("triton: cute needs an SM120/SM121 GPU") == 3 * len(policy.VARIANTS)
