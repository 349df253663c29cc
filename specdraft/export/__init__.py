"""Exports for other engines: the target as a Hugging Face folder (``export_target``) and trained
drafters in the serving engines' formats (``export_drafter``)."""

from specdraft.export.drafter import export_drafter
from specdraft.export.target import export_target

__all__ = ["export_drafter", "export_target"]
