"""Dynamic K end to end: the gateway sends a dynamic-K request's bound once, in its
stream's Start, and the verifier chooses each step's K within it (the controller's
own tests: tests/verifier/test_speculation.py); with dynamic K off a request's K is
the deployment's static K."""

from __future__ import annotations

import openai

from tests.gateway.stack import K_MAX, MODEL_NAME, GatewayStack, OracleDraftModel


class FirstRightDrafter(OracleDraftModel):
    """Only the first draft token is right; records the K asked for at every step."""

    def __init__(self, model):
        super().__init__(model)
        self.wanted: list[int] = []

    def propose(self, wanted):
        self.wanted.extend(wanted.values())
        return super().propose(wanted)

    def draft(self, ctx, k):
        first = OracleDraftModel.draft(self, ctx, 1)
        # Wrong on purpose: the target's greedy token is never its predecessor + 1 twice.
        return first + [(first[0] + 1 + i) % self.model.config.vocab_size for i in range(k - 1)]


def auto_chat(s: GatewayStack, method: str, max_tokens: int, base_url: str | None = None):
    """One greedy chat at dynamic K ("auto") with `method` (through another gateway of the
    stack's verifiers at base_url); its text is the target's."""
    client = openai.OpenAI(base_url=base_url or s.base_url, api_key="x", max_retries=0)
    content = "Count to twenty."
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=max_tokens, extra_body={"speculative": {"method": method,
                                                           "num_speculative_tokens": "auto"}})
    assert resp.choices[0].message.content == s.reference(s.chat_ids(content), max_tokens)[0]
    return resp


def test_static_default_k_with_dynamic_k_off(loop, model, smollm2_dir):
    drafter = FirstRightDrafter(model)
    s = GatewayStack(loop, model, smollm2_dir, drafters={"draft_model": drafter},
                     default_method="draft_model", default_auto_k=False)
    try:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        for _ in range(3):
            client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "Count to twenty."}],
                temperature=0, max_tokens=40)
        asked = [k for k in drafter.wanted if k]
        # K = 4 every step but a request's last, which max_tokens may cut shorter.
        assert max(asked) == 4 and sum(k != 4 for k in asked) <= 3, asked
    finally:
        s.close()


def test_gateway_cli_dynamic_k_flag():
    from gateway.__main__ import build_parser

    p = build_parser()
    assert p.parse_args([]).dynamic_k is True
    assert p.parse_args(["--no-dynamic-k"]).dynamic_k is False
    assert p.parse_args(["--num-speculative-tokens", "3"]).num_speculative_tokens == 3


def test_a_verifier_that_chooses_k_itself_gets_the_bound_and_no_updates(loop, model,
                                                                        smollm2_dir):
    """The gateway opens a dynamic-K stream with the request's bound and auto_k, and
    sends no PolicyUpdate of K, through one gateway or two (the verifier sees the
    step's batch whatever sent it); the verifier's engine chooses K within the bound
    each step, and the text is the target's."""
    from gateway.core import Gateway, GatewayConfig
    from gateway.replicas import ReplicaPool
    from gateway.service import serve as serve_gateway
    from tests.verifier.test_speculation import MadeUpCost

    drafter = FirstRightDrafter(model)
    s = GatewayStack(loop, model, smollm2_dir, drafters={"draft_model": drafter})
    servicer = s.replicas[0].servicer
    # Made-up step times (10 ms + 2 ms a row): a tiny model's real ones are a few ms,
    # near the drafter's round trip, and whether drafting pays would be the machine's.
    controller = servicer.engine.controller
    controller.cost = MadeUpCost(controller.config.cost_weight)
    received = []
    servicer._apply_update = lambda request_id, policy, update: received.append(update)
    second = Gateway(GatewayConfig(model_name=MODEL_NAME), s.tokenizer,
                     ReplicaPool([s.replicas[0].address], poll_interval_s=0.1))
    service = loop.run(serve_gateway(second, "127.0.0.1", 0, "127.0.0.1:0", None))
    try:
        assert s.replicas[0].load().speculation_controller
        for base_url in (s.base_url, f"http://127.0.0.1:{service.http_port}/v1", s.base_url):
            resp = auto_chat(s, "draft_model", 30, base_url)
            assert resp.model_extra["spec_decode"]["num_drafts"] > 0
        assert received == []
        assert drafter.wanted and max(drafter.wanted) <= K_MAX
        assert servicer.engine.controller is not None
    finally:
        loop.run(service.stop(1.0))
        s.close()
