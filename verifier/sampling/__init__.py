"""The verifier's sampling: per-request parameters and speculative rejection sampling."""
