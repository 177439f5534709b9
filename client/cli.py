"""``remat-client``: the command group, its entry point ``main()``, and the registration of every command.

Exit codes (README.md, "CLI reference"): 0 success, 2 bad input (one line on stderr, no traceback), 1 anything
else; ``zoo`` adds 130 when interrupted. ``main()`` is where exceptions become those one-line messages and codes.

The commands live one group to a module — ``cli_plan`` (plan, trace, measure, evaluate), ``cli_jobs`` (submit,
status), ``cli_show`` (show, config show), ``zoo_command`` (zoo) — and what they share in ``cli_common``. None of
them imports torch, the worker or the service at module level, so that ``remat-client plan --trace`` and
``--help`` start in a fraction of a second; the MODEL commands load torch lazily through
``remat.client.local_planner``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import click

from remat.client.cli_common import (
    ENVIRONMENT_BEFORE_CONFIG,
    InputError,  # noqa: F401  (re-exported: the public name callers catch)
)
from remat.client.cli_jobs import status_command, submit_command
from remat.client.cli_max_batch import max_batch_command
from remat.client.cli_plan import evaluate_command, measure_command, plan_command, trace_command
from remat.client.cli_show import config_group, show_command
from remat.client.errors import RematError
from remat.client.zoo_command import zoo_command

PROG = "remat-client"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="remat", prog_name=PROG)
def cli() -> None:
    """remat: measured activation-checkpointing plans for PyTorch training."""


# A new command: its own module (or its group's), imported above and registered here in one line.
# Click lists the commands sorted by name, whatever the order of these lines.
cli.add_command(plan_command)
cli.add_command(submit_command)
cli.add_command(status_command)
cli.add_command(trace_command)
cli.add_command(measure_command)
cli.add_command(evaluate_command)
cli.add_command(show_command)
cli.add_command(config_group)
cli.add_command(zoo_command)
cli.add_command(max_batch_command)


def _one_line(message: str) -> str:
    """Click spreads some messages (choices, usage) over lines; the contract is one line."""
    return " ".join(message.split())


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console-script entry point: one-line errors, the documented exit codes."""
    from remat.client.config import ConfigError, apply_to_environment
    from remat.client.host_memory import keep_freed_memory

    keep_freed_memory()  # its commands time training steps on CPU (NOTE [ page faults on CPU ])
    ENVIRONMENT_BEFORE_CONFIG.clear()
    ENVIRONMENT_BEFORE_CONFIG.update(os.environ)
    try:
        apply_to_environment()  # the config file feeds the REMAT_* layer that flags override
    except ConfigError as exc:
        click.echo(f"{PROG}: error: {exc}", err=True)
        sys.exit(2)
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name=PROG, standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo(f"{PROG}: aborted", err=True)
        sys.exit(1)
    except click.UsageError as exc:
        click.echo(f"{PROG}: error: {_one_line(exc.format_message())}", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        click.echo(f"{PROG}: error: {_one_line(exc.format_message())}", err=True)
        sys.exit(exc.exit_code)
    except RematError as exc:
        click.echo(f"{PROG}: error: {_one_line(str(exc))}", err=True)
        sys.exit(2)
    except Exception as exc:  # the last line of defence: one line, exit 1, traceback only on request
        if os.environ.get("REMAT_DEBUG"):
            raise
        click.echo(f"{PROG}: failed: {type(exc).__name__}: {_one_line(str(exc))} (REMAT_DEBUG=1 shows the traceback)",
                   err=True)
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
