"""Benchmarks and offline analyses: users of the engine that measure speed, acceptance and coverage."""
