"""The plan service's web pages: read-only HTML over the plan database, rendered on the server.

``pages`` (the Jinja2 environment, autoescaping everything), ``formatting`` (how numbers read on a page),
``links`` (the pages' URLs), ``views`` (records → what a page shows), ``fetch_lines`` (the lines that fetch a
plan), ``pictures`` + ``svg`` (the two pictures, drawn as SVG and cached). The routes are
``remat.service.api.routes.ui``; nothing here imports the web framework.
"""
