"""``remat-client show`` and ``config show``: what this machine already holds, read without planning anything.

``show`` reads the local plan store through ``remat.client.local_planner.local_planner()`` (the store answers
without torch); ``config show`` reads the settings' layers as ``main()`` found them before the config file
fed the environment.
"""

from __future__ import annotations

import click

from remat.client.cli_common import (
    ENVIRONMENT_BEFORE_CONFIG,
    OutputFile,
    emit_json,
    fail_input,
    model_kwargs_option,
    model_options,
    model_request,
    print_model_table,
)
from remat.client.errors import RematError
from remat.client.plots import PLOT_FORMATS

__all__ = ["config_group", "show_command"]

MIN_HASH_PREFIX = 8
"""`show HASH`: the shortest hash prefix read as a hash rather than a model name."""


@click.command("show")
@click.argument("target", metavar="MODEL|HASH")
@model_options
@model_kwargs_option
@click.option("--plot", "plot_path", type=OutputFile(suffixes=PLOT_FORMATS), default=None,
              metavar="FILE.png", help="Also draw memory over one step (none and linear) and overhead vs peak.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: a list of reports.")
def show_command(target: str, batch_size: int | None, input_shape: str | None, seq_len: int | None, device: str,
                 grads: str, dtype: str, model_kwargs: str | None, plot_path: str | None, as_json: bool) -> None:
    """Show what the local plan store holds for MODEL (at the given options) or for an architecture HASH.

    MODEL as for `plan`; HASH is a model_hash or a prefix of at least 8 hex digits (every input and
    convention stored for that architecture). Plans whose measurement is missing show "-".

    \b
    Example:
      remat-client show resnet18 --batch-size 2 --input-shape 3,64,64 --plot memory.png
      remat-client show 46118544bb70
    """
    import re

    from remat.client.local_planner import local_planner

    by_hash = bool(re.fullmatch(r"[0-9a-f]+", target)) and len(target) >= MIN_HASH_PREFIX
    if by_hash:
        if any(v is not None for v in (batch_size, input_shape, seq_len, model_kwargs)):
            fail_input("a HASH names every stored input of an architecture: --batch-size, --input-shape, "
                       "--seq-len and --model-kwargs apply to MODEL")
        reports, what = local_planner().stored_reports(model_hash=target), f"model_hash {target}…"
    else:
        request = model_request(target, batch_size, input_shape, device, grads, dtype, model_kwargs, seq_len)
        reports = local_planner().stored_reports(request=request)
        what = f"{request.name} at input {list(request.input_shape)} {request.dtype}, {request.device}, " \
               f"grads={request.grads}"
    if not reports:
        hint = ""
        if not by_hash:
            _check_model_name(target)
            hint = f"; `remat-client plan {target}` profiles and plans it"
        raise click.ClickException(f"the local plan store has nothing for {what}{hint}")
    if plot_path is not None:
        from remat.client.plots import plot_report

        try:
            written = plot_report(reports[0], plot_path)
        except RematError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"{written}: memory over one step and overhead vs peak of {reports[0].request.name}", err=True)
    if as_json:
        emit_json([report.to_dict() for report in reports])
        return
    for report in reports:
        print_model_table(report, "stored")


def _check_model_name(target: str) -> None:
    """A torchvision name nothing is stored for is checked here, and only here (the check imports
    torchvision): an unknown one is bad input naming close matches, not a hint to plan it."""
    from remat.client.errors import UnknownModelError
    from remat.client.model_spec import canonical_spec, source_of
    from remat.client.zoo import canonical_name

    spec = canonical_spec(target)
    if source_of(spec) == "torchvision":
        try:
            canonical_name(spec)
        except UnknownModelError as exc:
            fail_input(str(exc))


@click.group("config")
def config_group() -> None:
    """The client's settings: flags, then REMAT_* environment variables, then the config file.

    \b
    Example:
      remat-client config show
    """


@config_group.command("show")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def config_show_command(as_json: bool) -> None:
    """Print each setting in effect and where it came from (env, file or default); tokens are masked.

    \b
    Example:
      REMAT_CONFIG=./remat.toml remat-client config show --json
    """
    from remat.client import config

    path = config.config_path()
    rows = config.effective(path=path, environ=ENVIRONMENT_BEFORE_CONFIG)
    shown = [{"name": setting.name, "env": setting.env,
              "value": ("***" if setting.secret and value is not None else value), "source": source,
              "help": setting.help} for setting, value, source in rows]
    warning = None
    if path.exists() and not config.private_enough(path):
        warning = f"{path} is readable by other users; it may hold api_token: chmod 600 {path}"
    if as_json:
        emit_json({"config_file": str(path), "config_file_exists": path.exists(), "settings": shown,
                   "warning": warning})
        return
    click.echo(f"config file: {path}{'' if path.exists() else ' (none)'}")
    for row in shown:
        value = "-" if row["value"] is None else row["value"]
        click.echo(f"  {row['name']:<15} {value!s:<40} {row['source']}")
    if warning:
        click.echo(f"warning: {warning}", err=True)
