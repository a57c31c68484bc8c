"""Running Weir's parts as plain local processes (development fleets and tests)."""
