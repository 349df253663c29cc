"""Drafter network parts: layers, heads, the frozen LM-head rows, the three drafter networks and their checkpoints."""
