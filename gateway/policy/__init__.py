"""Per-request speculation policy: which method, how many draft tokens (K), when to stop.

Pure functions and small dataclasses, no gRPC, one concept a module: the request's
`speculative` field (request.py); admission, which turns it and the chosen verifier's
load into a `Decision` (admission.py); the measured step-time profile and its file
format (itl_profile.py); the step-time model fitted online from the verifiers' step
statistics, which gives the profile where no file does (online_profile.py); goodput
and the best K (goodput.py); and `DynamicK`, which picks each round's K while a
request runs (dynamic_k.py). docs/design.md ("Policies") has the reasoning.
"""
