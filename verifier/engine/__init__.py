"""The verifier's engine: scheduler, sequences and the step loop."""

from verifier.engine.engine import (
    Engine,
    EngineConfig,
    NoTokenAllowed,
    StepFailed,
    StepOutput,
    StepTimes,
    TokenLogprob,
)
from verifier.engine.proposer import Outcome, Proposal, Proposer
from verifier.engine.sequence import FinishReason, Request

__all__ = ["Engine", "EngineConfig", "FinishReason", "NoTokenAllowed", "Outcome", "Proposal",
           "Proposer", "Request", "StepFailed", "StepOutput", "StepTimes", "TokenLogprob"]
