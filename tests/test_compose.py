"""docker-compose.yml, Dockerfile and .env.example: valid for a real compose implementation, and wired right.

No Docker engine runs here: ``docker-compose config`` (Debian's docker-compose 1.29, or ``docker compose`` v2)
parses, validates and interpolates the file without one. The resolved file is then checked service by
service: commands (and that the commands exist and accept those options), environment, depends_on,
healthchecks, the GPU reservation, and that no secret is written in the repository.
Without docker-compose the tests skip, except under CI=true where they fail (.ci/run installs it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.conftest import IN_CI

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
BIN = Path(sys.executable).parent

SERVICES = {"postgres", "redis", "migrate", "api", "worker-cpu", "worker-gpu", "flower"}
REMAT_SERVICES = ("migrate", "api", "worker-cpu", "worker-gpu")  # read ServiceSettings (REMAT_*)
AFTER_MIGRATION = ("api", "worker-cpu", "worker-gpu")
WORKERS = ("worker-cpu", "worker-gpu")

# Sentinels, not secrets: the values compose interpolates in this test.
SECRETS = {
    "POSTGRES_PASSWORD": "pg-sentinel-5d1f",
    "REMAT_API_TOKEN": "api-sentinel-9c3e",
    "FLOWER_BASIC_AUTH": "watcher:flower-sentinel-2b7a",
}
SECRET_KEYS = (*SECRETS, "REMAT_READ_TOKEN")


def _compose_command() -> list[str] | None:
    path = shutil.which("docker-compose")
    if path:
        return [path]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


@pytest.fixture(scope="module")
def compose() -> list[str]:
    command = _compose_command()
    if command is None:
        reason = "docker-compose not installed (apt-get install docker-compose)"
        if IN_CI:
            pytest.fail(f"{reason}; CI requires it (.ci/run installs it)")
        pytest.skip(reason)
    return command


@pytest.fixture(scope="module")
def empty_env_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Instead of a developer's own .env beside the compose file: only what each test passes counts.
    path = tmp_path_factory.mktemp("compose") / "empty.env"
    path.write_text("")
    return path


def _config(compose: list[str], env_file: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``compose config`` in a clean environment (no REMAT_*/COMPOSE_* leaking in from the caller)."""
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(env_file.parent), **env}
    return subprocess.run(
        [*compose, "--project-directory", str(ROOT), "--env-file", str(env_file), "-f", str(COMPOSE_FILE),
         "--profile", "gpu", "config"],
        capture_output=True, text=True, env=clean, cwd=env_file.parent, timeout=120,
    )


@pytest.fixture(scope="module")
def resolved(compose: list[str], empty_env_file: Path) -> dict[str, Any]:
    result = _config(compose, empty_env_file, SECRETS)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def services(resolved: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return resolved["services"]


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    """The file as written (YAML anchors merged, ``${...}`` not interpolated)."""
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _command(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    assert isinstance(command, list), f"command should be a list, not a shell string: {command!r}"
    return [str(part) for part in command]


def _option(command: list[str], *names: str) -> str:
    for i, part in enumerate(command):
        if part in names:
            return command[i + 1]
        for name in names:
            if part.startswith(name + "="):
                return part.split("=", 1)[1]
    raise AssertionError(f"{' or '.join(names)} not in {command}")


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _healthcheck_text(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    return " ".join(test) if isinstance(test, list) else test


# --- the file is valid, complete, and refuses to run without its secrets ------------------------------------

def test_every_service_is_defined(services: dict[str, Any]) -> None:
    assert set(services) == SERVICES


@pytest.mark.parametrize("name", sorted(SECRETS))
def test_a_missing_secret_is_refused_by_name(compose: list[str], empty_env_file: Path, name: str) -> None:
    env = {k: v for k, v in SECRETS.items() if k != name}
    result = _config(compose, empty_env_file, env)
    assert result.returncode != 0
    assert name in result.stderr


def test_env_example_is_a_complete_template_of_placeholders(compose: list[str], empty_env_file: Path) -> None:
    result = _config(compose, ENV_EXAMPLE, {})
    assert result.returncode == 0, result.stderr
    values = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
                  if line.strip() and not line.lstrip().startswith("#"))
    for name in SECRETS:
        assert "change-me" in values[name], f".env.example must hold a placeholder for {name}, not a value"


def test_no_secret_is_written_in_the_repository(raw: dict[str, Any]) -> None:
    for name, service in raw["services"].items():
        for key, value in _env(service).items():
            if key in SECRET_KEYS:
                assert re.fullmatch(rf"\$\{{{key}(:[-?][^}}]*)?\}}", value), f"{name}: {key} must be ${{{key}...}}"
            if key == "REMAT_DATABASE_URL":
                assert re.match(r"[\w+]+://\w+:\$\{POSTGRES_PASSWORD[:}]", value), \
                    f"{name}: the database URL's password must be ${{POSTGRES_PASSWORD...}}"
    assert "change-me" not in COMPOSE_FILE.read_text()
    assert ".env" in (ROOT / ".dockerignore").read_text().split(), "the build context must not take .env"
    if (ROOT / ".git").exists() and shutil.which("git"):
        ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT).returncode == 0
    else:
        ignored = ".env" in (ROOT / ".gitignore").read_text().split()
    assert ignored, ".env must be git-ignored"


# --- order and health -----------------------------------------------------------------------------------------

def test_services_start_after_healthy_backends_and_a_finished_migration(services: dict[str, Any]) -> None:
    for name in AFTER_MIGRATION:
        depends = services[name]["depends_on"]
        assert depends["postgres"]["condition"] == "service_healthy", name
        assert depends["redis"]["condition"] == "service_healthy", name
        assert depends["migrate"]["condition"] == "service_completed_successfully", name
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert str(services["migrate"].get("restart", "no")) == "no", "migrate runs once"
    # Flower needs only the broker: it stays up to show the queues even when the database or migration fails.
    assert services["flower"]["depends_on"]["redis"]["condition"] == "service_healthy"
    # Every service_healthy dependency has a healthcheck to wait for.
    for name, service in services.items():
        for dep, spec in (service.get("depends_on") or {}).items():
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}, which has no healthcheck"


def test_healthchecks(services: dict[str, Any]) -> None:
    postgres = _healthcheck_text(services["postgres"])
    assert "pg_isready" in postgres and "$${POSTGRES_USER}" in postgres and "$${POSTGRES_DB}" in postgres
    assert _healthcheck_text(services["redis"]) == "CMD redis-cli ping"
    api = _healthcheck_text(services["api"])
    port = _option(_command(services["api"]), "--port")
    assert f"127.0.0.1:{port}/healthz" in api and "curl" not in api  # no curl in the slim image


# --- commands -------------------------------------------------------------------------------------------------

def test_commands(services: dict[str, Any]) -> None:
    assert _command(services["migrate"]) == ["remat-service", "migrate"]
    api = _command(services["api"])
    assert api[0] == "remat-service" and _option(api, "--host") == "0.0.0.0"
    assert any(str(p.get("target") if isinstance(p, dict) else p).endswith(_option(api, "--port"))
               for p in services["api"]["ports"])
    queues = {name: set(_option(_command(services[name]), "--queues", "-Q").split(",")) for name in WORKERS}
    assert queues == {"worker-cpu": {"cpu", "plan"}, "worker-gpu": {"cuda"}}
    hostnames = [_option(_command(services[name]), "--hostname", "-n") for name in WORKERS]
    assert len(set(hostnames)) == len(hostnames) and all("%h" in h for h in hostnames), \
        "worker names must differ per service and per replica (%h: the container's hostname)"
    assert _option(_command(services["worker-gpu"]), "--concurrency", "-c") == "1", "one process per GPU"
    flower = _command(services["flower"])
    assert flower[:4] == ["celery", "--app", "remat.worker.celery_app:app", "flower"]


def test_workers_hand_back_their_job_when_stopped(services: dict[str, Any]) -> None:
    # SIGQUIT: Celery's soft-then-cold shutdown re-queues the running late-ack message; the grace period
    # must outlast worker_soft_shutdown_timeout or Docker's SIGKILL cuts it short.
    from remat.worker.celery_app import SOFT_SHUTDOWN_S

    for name in WORKERS:
        assert services[name]["stop_signal"] == "SIGQUIT", name
        assert _seconds(services[name]["stop_grace_period"]) >= SOFT_SHUTDOWN_S + 20, name


def _seconds(duration: str) -> float:
    """A compose duration: ``60s``, ``1m30s`` (v2 prints ``1m0s``), ``1h``."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[u] for n, u in parts)


def test_gpu_worker_reserves_one_nvidia_gpu(services: dict[str, Any]) -> None:
    devices = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    (device,) = devices
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert ("count" in device) != ("device_ids" in device), "count and device_ids are exclusive"
    assert device.get("count") == 1 or len(device.get("device_ids", [])) == 1, "one GPU per worker process"
    assert "gpu" in services["worker-gpu"].get("profiles", []), "a CPU-only host must be able to `up` the rest"
    assert "deploy" not in services["worker-cpu"]


# --- environment ----------------------------------------------------------------------------------------------

def test_environment_points_at_the_compose_services(services: dict[str, Any]) -> None:
    from remat.service.config import ServiceSettings

    known = {f"REMAT_{field.upper()}" for field in ServiceSettings.model_fields}
    postgres = _env(services["postgres"])
    prefixes = set()
    for name in REMAT_SERVICES:
        env = _env(services[name])
        assert {k for k in env if k.startswith("REMAT_")} <= known, f"{name}: unknown REMAT_ setting"
        db = urlsplit(env["REMAT_DATABASE_URL"])
        assert db.scheme == "postgresql+psycopg" and (db.hostname, db.port) == ("postgres", 5432), name
        assert db.username == postgres["POSTGRES_USER"] and db.path == "/" + postgres["POSTGRES_DB"], name
        assert db.password == SECRETS["POSTGRES_PASSWORD"] == postgres["POSTGRES_PASSWORD"], name
        for key in ("REMAT_REDIS_URL", "REMAT_BROKER_URL"):
            url = urlsplit(env[key])
            assert url.scheme == "redis" and (url.hostname, url.port) == ("redis", 6379), f"{name}: {key}"
        prefixes.add(env.get("REMAT_QUEUE_PREFIX", ""))
    flower = _env(services["flower"])
    assert urlsplit(flower["REMAT_BROKER_URL"]).hostname == "redis"
    prefixes.add(flower.get("REMAT_QUEUE_PREFIX", ""))
    assert len(prefixes) == 1, "the API, the workers and Flower must agree on the queue names"
    assert flower["FLOWER_BASIC_AUTH"] == SECRETS["FLOWER_BASIC_AUTH"]

    api = _env(services["api"])
    assert api["REMAT_API_TOKEN"] == SECRETS["REMAT_API_TOKEN"]
    assert api["REMAT_AUTO_MIGRATE"] == "false", "the migrate service migrates, once"
    others = [name for name in services if name != "api" and "REMAT_API_TOKEN" in _env(services[name])]
    assert not others, f"only the API needs the write token: {others}"


# --- the commands exist and accept those options ----------------------------------------------------------------

def test_commands_are_installed_scripts_that_accept_the_options(services: dict[str, Any]) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    commands = {name: _command(services[name]) for name in REMAT_SERVICES}
    for name, (program, *_) in commands.items():
        assert program in scripts, f"{name}: {program} is not a console script in pyproject.toml"
    # The installed console scripts start and print their options (run side by side: each takes seconds).
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMAT_")}
    running = {program: subprocess.Popen([str(BIN / program), "--help"], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, env=env)
               for program in {command[0] for command in commands.values()}}
    helps: dict[str, str] = {}
    for program, process in running.items():
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, f"{program} --help: {err}"
        helps[program] = out
    for name, (program, *args) in commands.items():
        for flag in (a for a in args if a.startswith("--")):
            assert flag in helps[program], f"{name}: {program} --help does not know {flag}"
        _parse(program, args)
    assert (BIN / "celery").exists(), "flower's command is celery's console script"


def _parse(program: str, args: list[str]) -> None:
    """Parse ``args`` with the command's own parser, without running it."""
    if program == "remat-service":
        from remat.service.config import ServiceSettings
        from remat.service.main import _parser

        _parser(ServiceSettings()).parse_args(args)  # SystemExit(2) on anything it does not accept
    elif program == "remat-worker":
        from remat.worker.cli import worker

        worker.make_context(program, list(args))  # click.UsageError on an unknown option or bad value
    else:
        raise AssertionError(f"no parser known for {program}")


def test_flower_is_in_the_image_and_its_options_exist(services: dict[str, Any]) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(req.startswith("flower") for req in project["optional-dependencies"]["cluster"])
    dockerfile = (ROOT / "Dockerfile").read_text()
    syncs = [line for line in dockerfile.splitlines() if "uv sync" in line]
    assert syncs and all("--locked" in s and "--no-dev" in s and "--extra cluster" in s for s in syncs)
    # Workers build allow-listed hf: models: transformers is in the image.
    assert all("--extra hf" in s for s in syncs)
    from celery import Celery

    from remat.worker.celery_app import app

    assert isinstance(app, Celery)
    try:
        from flower.options import options
    except ImportError:
        pytest.fail("flower is not installed: it is in the dev group (uv sync)")
    command = _command(services["flower"])
    for arg in command[command.index("flower") + 1:]:
        name = arg.removeprefix("--").split("=", 1)[0]
        assert name in options, f"flower has no option {arg}"


def test_dockerfile_builds_from_the_lock_and_runs_unprivileged() -> None:
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    copies = [i for i, line in enumerate(lines) if line.startswith("COPY") and "--from" not in line]
    assert lines[copies[0]].split()[1:] == ["pyproject.toml", "uv.lock", "./"], "dependencies before the source"
    final_stage = lines[max(i for i, line in enumerate(lines) if line.startswith("FROM")):]
    users = [line.split()[1] for line in final_stage if line.startswith("USER")]
    assert users and users[-1] not in ("root", "0")
