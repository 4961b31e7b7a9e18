"""What the verifier service asks of the proposer inside vLLM's engine, over collective RPC.

vLLM adds this class to its worker's bases (`worker_extension_cls`), so its methods can
be called by name with `AsyncLLM.collective_rpc`, on every worker, between engine steps.
Only the proposer of the first tensor-parallel rank drafts; the others answer empty.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verifier.vllm.proposer import RemoteProposer

WORKER_EXTENSION = f"{__name__}.ProposerControl"


class ProposerControl:
    def _specdec_proposer(self) -> RemoteProposer | None:
        runner = getattr(self, "model_runner", None)
        proposer = getattr(runner, "drafter", None)
        return proposer if isinstance(proposer, RemoteProposer) and proposer.drafting else None

    def specdec_set_num_speculative_tokens(self, updates: Mapping[str, int]) -> None:
        """K per request (named by its policy key) from the next step on."""
        if (proposer := self._specdec_proposer()) is not None:
            proposer.set_num_speculative_tokens(updates)

    def specdec_drafters(self) -> list[dict[str, Any]]:
        """The drafters and whether each is up; [] on a rank that does not draft."""
        proposer = self._specdec_proposer()
        return proposer.drafters() if proposer is not None else []
