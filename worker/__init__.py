"""remat's heavy side: profilers, the measured training step, the pipeline, and the two ways it runs.

The pipeline runs here in the local mode (``remat.worker.local``, the client's ``LocalPlanner`` through the
``remat.local_planner`` entry point) or in the Celery workers (``remat.worker.tasks``). Planning itself is the
client's torch-free core (``remat.client.planning``); this package profiles and measures with torch, and stores
through the service's repository. Nothing below imports this package.
"""
