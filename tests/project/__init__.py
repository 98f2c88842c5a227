"""project tests."""
