"""End-to-end tests: whole multi-process fleets, driven like a user drives them."""
