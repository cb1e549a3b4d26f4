"""Modules built from ops."""
