"""Rendering the web pages: one Jinja2 environment that escapes everything, and the headers every page carries.

Autoescaping is on for every template (model names, job errors and call signatures are text a client sent), and
an undefined name is an error rather than an empty string, so a template that refers to something a view no
longer provides fails its test instead of rendering a blank cell. The pages use no script and no inline style:
``SECURITY_HEADERS``' policy allows only this server's stylesheet and pictures.
"""

from __future__ import annotations

from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined

from remat.service.ui.formatting import FILTERS
from remat.service.ui.links import UI_PREFIX, key_url, with_query

__all__ = ["PAGE_SIZE", "SECURITY_HEADERS", "render", "render_error"]

PAGE_SIZE = 50
"""Rows of one table page (architectures, jobs, zoo batches)."""

SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
                               "base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}

_ENV = Environment(loader=PackageLoader("remat.service.ui", "templates"), autoescape=True,
                   undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, auto_reload=False)
_ENV.filters.update(FILTERS)
_ENV.globals.update(key_url=key_url, with_query=with_query, UI=UI_PREFIX, page_size=PAGE_SIZE)


def render(template: str, *, refresh: int | None = None, nav: str | None = None, **context: Any) -> str:
    """The page ``template`` (a file in templates/) filled with ``context``; ``refresh``: seconds after which the
    page reloads itself (while it shows running work), ``nav``: the section it belongs to."""
    return _ENV.get_template(template).render(refresh=refresh, nav=nav, **context)


def render_error(status: int, detail: str) -> str:
    """The page of an error (404 for an unknown key or job, 401, 422 naming the parameter)."""
    return render("error.html", status=status, detail=detail)
