"""reference tests."""
