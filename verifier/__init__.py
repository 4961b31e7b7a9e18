"""specdec verifier service."""
