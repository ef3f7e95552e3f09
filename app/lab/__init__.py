"""Small pure helpers for the serving widgets' maths (no engine, no torch): economics and load shapes."""
