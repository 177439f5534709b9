"""Helpers shared by test packages."""
