"""Migration scripts, oldest first; see migrations/__init__.py."""
