"""Analysis: data movement per kernel, profiles, the global layout search."""
