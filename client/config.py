"""The client's configuration: command-line flags, then ``REMAT_*`` environment variables, then a config file.

The file is TOML at ``<user config dir>/remat/config.toml`` (``~/.config/remat/config.toml`` on Linux), or
where ``REMAT_CONFIG`` points::

    server = "http://plans.internal:8000"
    api_token = "…"            # keep the file private (chmod 600): `config show` warns when it is not
    database_url = "sqlite:////data/remat.sqlite"
    plan_cache_dir = "/data/remat-plans"
    timeout_s = 10

One mechanism feeds every reader: ``apply_to_environment`` copies each file value into its ``REMAT_*``
variable when that variable is unset, so click's flag-or-environment options, the local store's settings and
``remat.client.checkpoint`` all see the same layered value. ``effective`` says, per setting, the value in
effect and where it came from (``remat-client config show``).
"""

from __future__ import annotations

import os
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remat.client.errors import RematError
from remat.client.user_files import read_limited

__all__ = ["SETTINGS", "ConfigError", "Setting", "apply_to_environment", "config_path", "effective", "load_file"]


class ConfigError(RematError, ValueError):
    """The config file is unreadable or holds an unknown key or a value of the wrong type."""


@dataclass(frozen=True)
class Setting:
    name: str
    env: str
    kind: type
    help: str
    secret: bool = False


SETTINGS: tuple[Setting, ...] = (
    Setting("server", "REMAT_SERVER", str, "the remat service URL (plan, zoo --server, submit, checkpoint())"),
    Setting("api_token", "REMAT_API_TOKEN", str, "the service's write token (uploads, jobs)", secret=True),
    Setting("database_url", "REMAT_DATABASE_URL", str, "the local plan store (default: SQLite in the cache dir)"),
    Setting("plan_cache_dir", "REMAT_PLAN_CACHE_DIR", str, "the plan cache of checkpoint() (default: cache dir)"),
    Setting("timeout_s", "REMAT_TIMEOUT_S", float, "seconds a request to the service may take in all (default 10)"),
)
_BY_NAME = {s.name: s for s in SETTINGS}

MAX_CONFIG_FILE_BYTES = 2**20
"""The largest config file read: five settings fit in a few hundred bytes; ``REMAT_CONFIG`` naming something
else (a log, a device) is refused before it is read."""


def config_path() -> Path:
    """``REMAT_CONFIG``, else ``config.toml`` in the user's config directory for remat."""
    configured = os.environ.get("REMAT_CONFIG")
    if configured:
        return Path(configured).expanduser()
    from platformdirs import user_config_dir

    return Path(user_config_dir("remat")) / "config.toml"


def load_file(path: Path | None = None) -> dict[str, Any]:
    """The file's settings (empty when there is no file).

    Raises:
        ConfigError: not TOML, an unknown key or a value of the wrong type (one line naming file and key).
    """
    path = path or config_path()
    try:
        data = tomllib.loads(read_limited(path, MAX_CONFIG_FILE_BYTES, "a config file").decode("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # FileTooLargeError, UnicodeDecodeError and TOMLDecodeError among them
        raise ConfigError(f"config file {path}: {' '.join(str(exc).split())}") from None
    out: dict[str, Any] = {}
    for key, value in data.items():
        setting = _BY_NAME.get(key)
        if setting is None:
            raise ConfigError(f"config file {path}: unknown key {key!r}; known: {', '.join(_BY_NAME)}")
        if setting.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, setting.kind) or isinstance(value, bool):
            raise ConfigError(f"config file {path}: {key} must be a {setting.kind.__name__}, got {value!r}")
        out[key] = value
    return out


def apply_to_environment(path: Path | None = None) -> dict[str, Any]:
    """Copy the file's values into unset ``REMAT_*`` variables (flags and the environment win); returns them."""
    values = load_file(path)
    for key, value in values.items():
        setting = _BY_NAME[key]
        if not os.environ.get(setting.env):
            os.environ[setting.env] = str(value)
    return values


def effective(flags: dict[str, Any] | None = None, path: Path | None = None,
              environ: dict[str, str] | None = None) -> list[tuple[Setting, Any, str]]:
    """Each setting with the value in effect and where it came from: ``flag``, ``env NAME``, ``file PATH``
    or ``default``. Reads the environment as it was before ``apply_to_environment`` when given ``environ``."""
    path = path or config_path()
    env = environ if environ is not None else dict(os.environ)
    file_values = load_file(path)
    out = []
    for setting in SETTINGS:
        if flags and flags.get(setting.name) is not None:
            out.append((setting, flags[setting.name], "flag"))
        elif env.get(setting.env):
            out.append((setting, env[setting.env], f"env {setting.env}"))
        elif setting.name in file_values:
            out.append((setting, file_values[setting.name], f"file {path}"))
        else:
            out.append((setting, None, "default"))
    return out


def private_enough(path: Path) -> bool:
    """Whether only its owner can read ``path`` (a token in a world-readable file is a leaked token)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return True
    return not mode & (stat.S_IRGRP | stat.S_IROTH)
