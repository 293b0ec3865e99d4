"""`cdlm-serve serve`'s flags: one table, each in a group, each with its environment variable."""

from __future__ import annotations

import os

import pytest

from cdlm_serve.server import cli

# What the environment said before any test here ran (a developer may force an ISA for the suite).
_ISA_BEFORE = os.environ.get("CDLM_SERVE_CPU_ISA")


def test_every_flag_names_its_environment_variable_in_its_group(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for title in cli.GROUPS.values():
        assert f"\n{title}:\n" in text
    for flag in cli.FLAGS:
        assert flag.env in text, flag.name
    assert "CDLM_SERVE_MODEL" in text


def test_the_environment_sets_defaults_typed_like_the_command_line(monkeypatch):
    monkeypatch.setenv("CDLM_SERVE_MAX_QUEUE", "7")
    monkeypatch.setenv("CDLM_SERVE_SESSIONS_DISK_GB", "0.5")
    args = cli.build_parser().parse_args(["serve"])
    assert args.max_queue == 7 and args.sessions_disk_gb == 0.5
    assert args.port == 8000 and args.max_model_len is None  # the table's defaults, typed
    args = cli.build_parser().parse_args(["serve", "--max-queue", "9"])
    assert args.max_queue == 9  # the command line wins


def test_a_bad_environment_value_is_a_usage_error_naming_the_flag(monkeypatch, capsys):
    monkeypatch.setenv("CDLM_SERVE_PORT", "eighty")
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["serve"])
    assert exit_.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_a_switch_is_off_by_default_and_on_by_flag_or_environment(monkeypatch, capsys):
    assert cli.build_parser().parse_args(["serve"]).no_prefix_caching is False
    assert cli.build_parser().parse_args(["serve", "--no-prefix-caching"]).no_prefix_caching
    monkeypatch.setenv("CDLM_SERVE_NO_PREFIX_CACHING", "1")
    assert cli.build_parser().parse_args(["serve"]).no_prefix_caching is True
    monkeypatch.setenv("CDLM_SERVE_NO_PREFIX_CACHING", "maybe")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve"])
    assert "--no-prefix-caching" in capsys.readouterr().err


def test_cdlm_serve_help_shows_the_serve_flags_in_their_groups(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: cdlm-serve serve")
    for title in cli.GROUPS.values():
        assert f"\n{title}:\n" in text
    assert "cdlm-serve fetch" in text and "CDLM_SERVE_PREFIX_CACHE_MB" in text


@pytest.mark.parametrize("hours", ["-1", "nan", "inf"])
def test_a_responses_ttl_must_be_a_finite_number_of_hours(hours):
    args = cli.build_parser().parse_args(["serve", "--responses-ttl-hours", hours])
    with pytest.raises(SystemExit, match="--responses-ttl-hours must be >= 0"):
        cli.serve(args)


def test_a_cpu_isa_this_cpu_cannot_run_is_refused_at_start_up(monkeypatch):
    """--cpu-isa names a kernel build; one this CPU lacks (AVX512 on an AVX2 machine, or any
    where the kernels cannot run) stops the server with a clear message before it loads."""
    from cdlm_serve.models import kernels

    missing = [isa for isa in ("avx512", "avx2") if not kernels.cpu_has(isa)]
    if not missing:
        pytest.skip("this CPU runs every build: nothing to refuse")
    # serve() sets CDLM_SERVE_CPU_ISA for the kernels: recorded here, so that it is undone
    # after the test (the later tests' servers inherit this process's environment).
    monkeypatch.setenv(kernels.ISA_ENV, "native")
    args = cli.build_parser().parse_args(["serve", "--device", "cpu", "--cpu-isa", missing[0]])
    with pytest.raises(SystemExit, match=f"--cpu-isa {missing[0]}: this CPU cannot run it"):
        cli.serve(args)


def test_the_cli_leaves_no_cpu_isa_behind():
    """(The test above must not leak its --cpu-isa into the servers later tests start.)"""
    from cdlm_serve.models import kernels

    assert os.environ.get(kernels.ISA_ENV) == _ISA_BEFORE


def test_the_dtype_follows_the_kernels_this_cpu_runs(monkeypatch):
    """auto: bf16 wherever the fused kernels run (AVX2 or AVX512-BF16), fp32 where none do
    (as CDLM_SERVE_CPU_KERNELS=0 makes it here), and the start-up log says why."""
    import torch

    from cdlm_serve.models import kernels

    cpu = torch.device("cpu")
    if kernels.cpu_isa() is not None:
        assert cli.pick_dtype("auto", cpu) == torch.bfloat16
        assert kernels.cpu_isa() in cli.dtype_reason("auto", torch.bfloat16, cpu)
    monkeypatch.setenv("CDLM_SERVE_CPU_KERNELS", "0")
    assert cli.pick_dtype("auto", cpu) == torch.float32
    assert "CDLM_SERVE_CPU_KERNELS=0" in cli.dtype_reason("auto", torch.float32, cpu)
    assert cli.pick_dtype("float32", cpu) == torch.float32
