"""The FastAPI application of the plan service; see app.py."""
