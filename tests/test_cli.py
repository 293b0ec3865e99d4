"""`cdlm-serve serve`'s flags: one table, each in a group, each with its environment variable."""

from __future__ import annotations

import pytest

from server import cli


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
