"""Configuration layers: flags, then REMAT_* environment, then the config file — and what `config show` says."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from remat.client import config
from tests.utils.cli import run_cli


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No REMAT_* setting in the environment (restored after the test, also those the CLI copies in from the
    file), and REMAT_CONFIG pointing at a file in tmp_path."""
    for setting in config.SETTINGS:
        monkeypatch.setenv(setting.env, "placeholder")  # recorded as absent/original, so teardown restores it
        monkeypatch.delenv(setting.env)
    path = tmp_path / "remat.toml"
    monkeypatch.setenv("REMAT_CONFIG", str(path))
    return path


def _show(capsys: pytest.CaptureFixture[str]) -> dict:
    code, out, err = run_cli(capsys, "config", "show", "--json")
    assert code == 0, err
    return {row["name"]: row for row in json.loads(out)["settings"]}


def test_the_file_fills_what_the_environment_leaves_unset(capsys, clean_env: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    clean_env.write_text(f'server = "http://from-file:8000"\napi_token = "t0ken"\ntimeout_s = 3\n'
                         f'database_url = "sqlite:///{tmp_path / "from-file.sqlite"}"\n')
    clean_env.chmod(0o600)
    shown = _show(capsys)
    assert shown["server"]["value"] == "http://from-file:8000" and shown["server"]["source"] == f"file {clean_env}"
    assert shown["api_token"]["value"] == "***", "a token is never printed"
    assert shown["timeout_s"]["value"] == 3.0
    assert shown["plan_cache_dir"]["source"] == "default"

    monkeypatch.setenv("REMAT_SERVER", "http://from-env:8000")
    shown = _show(capsys)
    assert shown["server"] == {**shown["server"], "value": "http://from-env:8000", "source": "env REMAT_SERVER"}

    # The file's database_url is the one a command uses: the local store is created there.
    code, _, err = run_cli(capsys, "show", "resnet18", "--batch-size", "2")
    assert code == 1 and "has nothing for" in err
    assert (tmp_path / "from-file.sqlite").exists()


def test_flags_win_over_environment_and_file(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clean_env.write_text('server = "http://from-file:8000"\n')
    monkeypatch.setenv("REMAT_SERVER", "http://from-env:8000")
    rows = {s.name: (value, source) for s, value, source in config.effective({"server": "http://flag:1"})}
    assert rows["server"] == ("http://flag:1", "flag")


@pytest.mark.parametrize(("text", "message"), [
    ("sever = 1\n", "unknown key 'sever'; known: server, api_token"),
    ('timeout_s = "soon"\n', "timeout_s must be a float, got 'soon'"),
    ("server = \n", "config file"),
    ("server = true\n", "server must be a str, got True"),
])
def test_a_bad_config_file_is_one_line_and_exit_2_for_any_command(capsys, clean_env: Path, text: str,
                                                                   message: str) -> None:
    clean_env.write_text(text)
    for args in (["config", "show"], ["plan", "resnet18"]):
        code, out, err = run_cli(capsys, *args)
        assert code == 2 and message in err and str(clean_env) in err, err
        assert len(err.strip().splitlines()) == 1 and out == ""


def test_a_world_readable_file_is_warned_about(capsys, clean_env: Path) -> None:
    clean_env.write_text('api_token = "t0ken"\n')
    clean_env.chmod(0o644)
    code, out, err = run_cli(capsys, "config", "show")
    assert code == 0 and "readable by other users" in err and "chmod 600" in err
    assert "t0ken" not in out + err


def test_checkpoint_reads_the_service_from_the_file(clean_env: Path, tmp_path: Path) -> None:
    import remat.client
    from tests.utils.user_model import user_batches, user_model

    nobody = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once
    clean_env.write_text(f'server = "{nobody}"\nplan_cache_dir = "{tmp_path / "plans"}"\n'
                         f'database_url = "sqlite:///{tmp_path / "local.sqlite"}"\n')
    with pytest.warns(RuntimeWarning, match="plan service is not answering"):
        with pytest.warns(RuntimeWarning, match="training without checkpointing"):
            remat.client.checkpoint(user_model(), user_batches(1)[0][0], on_miss="none")
    assert os.environ["REMAT_SERVER"] == nobody
