"""specdec gateway service."""
