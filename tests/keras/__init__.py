"""keras tests."""
