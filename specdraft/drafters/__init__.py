"""Drafters: the protocol (``base``), the registry (``make_drafter``), the one budget policy
(``budget``) and one module per drafter."""

from specdraft.drafters.base import Drafter, NoDrafter
from specdraft.drafters.registry import DRAFTERS, REGISTRY, make_drafter

__all__ = ["DRAFTERS", "REGISTRY", "Drafter", "NoDrafter", "make_drafter"]
