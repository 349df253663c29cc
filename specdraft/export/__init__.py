"""Exports for other engines: the target as a Hugging Face folder (``export_target``)."""

from specdraft.export.target import export_target

__all__ = ["export_target"]
