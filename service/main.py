"""``remat-service``: run the plan service, or migrate its database.

    remat-service [serve] [--host H] [--port P] [--workers N] [--no-access-log]
    remat-service migrate [--revision head]
    remat-service downgrade --revision REV        # e.g. base
    remat-service current

Everything else (database, Redis, broker, tokens) comes from ``REMAT_*`` environment variables; see
docs/service.md. Host and port default to ``REMAT_HOST``/``REMAT_PORT`` (127.0.0.1:8000).
Exit codes: 0 success, 2 bad usage or configuration, 1 other failures.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from collections.abc import Sequence

import uvicorn
from pydantic import ValidationError
from sqlalchemy.exc import SQLAlchemyError
from uvicorn.supervisors import Multiprocess

from remat.service import migrate
from remat.service.config import ServiceSettings, redact_url
from remat.service.db import Database


def _parser(settings: ServiceSettings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remat-service", description="remat plan service")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the HTTP API (the default)")
    for p in (parser, serve):
        p.add_argument("--host", default=settings.host, help="bind address (REMAT_HOST)")
        p.add_argument("--port", type=int, default=settings.port, help="TCP port (REMAT_PORT)")
        p.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
        p.add_argument("--no-access-log", action="store_true", help="do not log every request")
    up = sub.add_parser("migrate", help="upgrade the database schema")
    up.add_argument("--revision", default="head")
    down = sub.add_parser("downgrade", help="downgrade the database schema")
    down.add_argument("--revision", required=True, help="target revision, e.g. base")
    sub.add_parser("current", help="print the database's schema revision")
    return parser


class NoDelayConfig(uvicorn.Config):
    """A uvicorn Config whose pre-bound listening socket keeps ``TCP_NODELAY`` on accepted connections.

    NOTE [uvicorn workers and Nagle]: with ``--workers N`` uvicorn binds the listening socket itself with
    ``proto=0``; accepted sockets inherit that, asyncio then skips ``TCP_NODELAY``, and every keep-alive
    response waits ~40 ms for the client's delayed ACK (Kludex/uvicorn#3149, open at uvicorn 0.54). Binding
    with ``IPPROTO_TCP`` here avoids it; a single worker is not affected. Module-level so that the worker
    processes (spawned) can unpickle it.
    """

    def bind_socket(self) -> socket.socket:
        if self.uds is not None or self.fd is not None:
            return super().bind_socket()
        family = socket.AF_INET6 if self.host and ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.set_inheritable(True)
        return sock


def _serve(args: argparse.Namespace, settings: ServiceSettings) -> int:
    if settings.auto_migrate:  # once here, not once per uvicorn worker
        db = Database(settings.database_url)
        try:
            migrate.ensure_current(db)
        finally:
            db.dispose()
    config = NoDelayConfig("remat.service.api.app:create_app", factory=True, host=args.host, port=args.port,
                           workers=args.workers, access_log=not args.no_access_log)
    if args.workers > 1:
        Multiprocess(config, sockets=[config.bind_socket()]).run()
    else:
        server = uvicorn.Server(config)
        server.run()
        if not server.started:
            return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = ServiceSettings()
    except ValidationError as exc:
        print(f"remat-service: bad configuration: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}",
              file=sys.stderr)
        return 2
    args = _parser(settings).parse_args(argv)
    try:
        if args.command in (None, "serve"):
            return _serve(args, settings)
        db = Database(settings.database_url)
        try:
            if args.command == "migrate":
                migrate.upgrade(db, args.revision)
            elif args.command == "downgrade":
                migrate.downgrade(db, args.revision)
            print(f"{redact_url(settings.database_url)}: {migrate.current_revision(db) or 'base'}")
        finally:
            db.dispose()
    except SQLAlchemyError as exc:
        print(f"remat-service: database {redact_url(settings.database_url)}: {str(exc).splitlines()[0]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
