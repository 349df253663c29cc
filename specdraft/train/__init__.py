"""Training drafters: data regeneration, the shared corpus and loop, one trainer per drafter kind."""
