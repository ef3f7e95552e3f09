"""Small pure helpers for the serving experiments (no engine, no torch)."""
