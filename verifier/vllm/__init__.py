"""The verifier on vLLM: our drafters as vLLM's custom proposer, our Verifier API over its engine.

Runs only where vLLM is installed (.venv-peers: `make vllm-venv`); nothing here imports
vLLM until it is used.
"""

from verifier.vllm.proposer import RemoteProposer

__all__ = ["RemoteProposer"]
