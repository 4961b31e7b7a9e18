"""Per-request speculation policy: which method, how many draft tokens (K), and
whether the request is admitted now.

Pure functions and small dataclasses, no gRPC, one concept a module: the request's
`speculative` field (request.py); admission, which turns it and the deployment into
the request's `specdec.speculation.SpeculationPolicy` (admission.py); load shedding
(shedding.py). Each step's K under load is
not the gateway's: the verifier's speculation controller chooses it from the step's
own batch (verifier/engine/speculation.py; docs/design.md section 5).
"""
