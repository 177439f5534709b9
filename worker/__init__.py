"""remat's heavy side: cost models, planners, profilers, the validator and the Celery tasks.

Planning modules (cost_models, planners, planning) import neither torch nor service code; profilers import
torch lazily where they need it.
"""
