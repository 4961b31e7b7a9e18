"""specdec drafter service."""
