"""The plan database, its HTTP API and cache (docs/service.md).

Entry points: ``remat.service.store.PlanStore`` (the database in-process: the local mode and the workers),
``remat.service.api.app.create_app`` (the ASGI app) and ``remat-service`` (``remat.service.main``).
"""
