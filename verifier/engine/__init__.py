"""The verifier's engine: scheduler, sequences and the step loop."""

from verifier.engine.engine import Engine, EngineConfig, StepOutput
from verifier.engine.proposer import Proposal, Proposer
from verifier.engine.sequence import FinishReason, Request

__all__ = ["Engine", "EngineConfig", "FinishReason", "Proposal", "Proposer", "Request", "StepOutput"]
