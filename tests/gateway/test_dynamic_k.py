"""Dynamic K end to end: the profile command measures a running verifier, and
a request's K changes mid-request once its own acceptance replaces the prior."""

from __future__ import annotations

import argparse
import asyncio
import itertools

import grpc
import httpx2
import openai
import pytest

from drafter.method import DrafterInfo
from gateway.policy.itl_profile import ItlProfile
from gateway.policy.online_profile import MIN_STEPS
from gateway.policy.outcome_table import TABLE_REFRESH_STEPS, table_of_level
from gateway.policy.request import SpeculativeRequest
from gateway.profile import add_arguments, profile
from gateway.types import GenerationRequest
from specdec.pb import common_pb2
from specdec.speculation import DraftOutcome
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


# Mild step cost and an optimistic prior (0.9 a position): K starts at the
# deployment's maximum (8).
OPTIMISTIC = ItlProfile(batch_sizes=(1, 16), ks=(0, 1, 2, 4, 6, 8),
                        itl_ms=((10, 11, 12, 14, 16, 18), (20, 22, 24, 28, 32, 36)),
                        acceptance={"draft_model": (0.9,)})


def test_k_changes_during_one_request(loop, model, smollm2_dir):
    drafter = FirstRightDrafter(model)
    # K starts at 8 (OPTIMISTIC). Once this request's own rates show that only position 1
    # is ever accepted, AL is the same for every K >= 1, and the cheapest of those, K = 1,
    # has the best goodput.
    s = GatewayStack(loop, model, smollm2_dir, drafters={"draft_model": drafter},
                     profile=OPTIMISTIC, dynamic_k_prior_steps=1)
    servicer = s.replicas[0].servicer
    received: list[tuple[bool, int]] = []  # (enabled, K) of each update the verifier got
    apply_update = servicer._apply_update

    def record(request_id, policy, update):
        apply_update(request_id, policy, update)
        received.append((policy.enabled, policy.effective_k))

    servicer._apply_update = record
    try:
        resp = auto_chat(s, "draft_model", 40)
        asked = [k for k in drafter.wanted if k]
        assert asked[0] == 8, asked
        assert asked[-1] == 1 and asked.count(1) >= 5, asked
        spec = resp.model_extra["spec_decode"]
        # After the switch every draft token is accepted (only the right one is asked for).
        assert spec["num_accepted_tokens"] > spec["num_drafts"] * 0.5
        text = httpx2.get(s.base_url.removesuffix("/v1") + "/metrics").text
        # The counter counts the updates the verifier got. Each change of K the drafter saw
        # was one; an update may also be replaced before a step runs it, or turn drafting
        # off for a few steps (where the drafter is not asked), or reach the verifier after
        # its last step (it answers a step the verifier has already followed).
        assert f"specdec_spec_decode_k_updates_total {float(len(received))}" in text
        changes = [b for a, b in itertools.pairwise(asked) if a != b]
        assert len(changes) <= len(received), (asked, received)
        assert all((True, k) in received for k in changes), (asked, received)
    finally:
        s.close()


def test_steps_that_accept_less_than_expected_lower_the_methods_calibration(
        loop, model, smollm2_dir):
    """Every drafting step of a dynamic-K request tells the gateway what its rates
    expected of the step's K and what it accepted; the prior says 0.9 a position and
    only the first draft is ever right, so the method's calibration falls below 1."""
    drafter = FirstRightDrafter(model)
    s = GatewayStack(loop, model, smollm2_dir, drafters={"draft_model": drafter},
                     profile=OPTIMISTIC, dynamic_k_prior_steps=1)
    online = s.gateway.online_profile
    seen: list[tuple[float, int]] = []
    calibrate = online.calibrate

    def record(method, expected, accepted):
        assert method == "draft_model"
        seen.append((expected, accepted))
        calibrate(method, expected, accepted)

    online.calibrate = record
    try:
        assert online.calibration("draft_model") == 1.0
        resp = auto_chat(s, "draft_model", 40)
        spec = resp.model_extra["spec_decode"]
        # One per drafting step (the prefill's response, which drafted nothing, is not one).
        assert len(seen) == spec["num_drafts"], (seen, spec)
        assert sum(a for _, a in seen) == spec["num_accepted_tokens"]
        assert all(a <= 1 for _, a in seen), seen
        # The first at K = 8 from the prior: 0.9 + 0.9^2 + ... + 0.9^8 = 5.1 drafts, times
        # the drafter's availability, which the prefill (asked, nothing drafted) lowered.
        assert 4.0 < seen[0][0] < 5.2, seen
        calibration = online.calibration("draft_model")
        assert calibration < 0.9
        text = httpx2.get(s.base_url.removesuffix("/v1") + "/metrics").text
        assert f'specdec_dynamic_k_calibration{{method="draft_model"}} {calibration}' in text
    finally:
        s.close()


def test_each_drafting_step_reports_the_context_its_drafter_takes_in(loop, model, smollm2_dir):
    """The online model learns what a drafter pays to take in context it has not seen
    (StepSample.backlog): at a request's first drafting step its prompt and the prefill's
    token, then each step the tokens of the step before."""
    s = GatewayStack(loop, model, smollm2_dir, drafters={"draft_model": FirstRightDrafter(model)})
    online = s.gateway.online_profile
    seen = []
    observe = online.observe

    def record(sample):
        seen.append(sample)
        observe(sample)

    online.observe = record
    try:
        content = "Count to twenty."
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": content}], temperature=0,
            max_tokens=30, extra_body={"speculative": {"method": "draft_model",
                                                       "num_speculative_tokens": 2}})
        drafting = [x for x in seen if x.num_speculative_tokens]
        assert len(drafting) >= 5
        assert all(x.backlog == 0 for x in seen if not x.num_speculative_tokens)
        assert drafting[0].backlog == len(s.chat_ids(content)) + 1
        assert [x.backlog for x in drafting[1:]] == [x.num_accepted + 1 for x in drafting[:-1]]
    finally:
        s.close()


def first_k_stack(loop, model, smollm2_dir, at_16: tuple[float, ...], **config
                  ) -> tuple[GatewayStack, GenerationRequest]:
    """A stack whose profile has K = 0, 1, 2, 4 at 10 / 10.5 / 11 / 12 ms for one
    sequence and `at_16` for 16 (prior 0.9 a position), and a dynamic-K request on it;
    config: the gateway's, beyond the stack's."""
    prof = ItlProfile(batch_sizes=(1, 16), ks=(0, 1, 2, 4),
                      itl_ms=((10, 10.5, 11, 12), at_16), acceptance={"draft_model": (0.9,)})
    s = GatewayStack(loop, model, smollm2_dir, drafters={"draft_model": FirstRightDrafter(model)},
                     profile=prof, **config)
    req = GenerationRequest(prompt_token_ids=tuple(s.chat_ids("Hi.")),
                            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=8),
                            speculative=SpeculativeRequest(method="draft_model", auto=True))
    return s, req


def test_a_bursts_first_k_counts_every_request_admitted(loop, model, smollm2_dir):
    """Requests of a burst are admitted before their streams open: the first to open
    chooses its first K for the batch they will make, not for an idle replica. Here
    drafting pays at one sequence and not at four."""
    s, req = first_k_stack(loop, model, smollm2_dir, at_16=(20, 200, 400, 800))
    try:
        alone = loop.run(s.gateway.open(req))
        start = alone._start(alone.replica).start
        assert start.speculation.num_speculative_tokens == 4, start
        assert start.disabled_reason == common_pb2.DISABLED_REASON_NONE
        alone.close()
        burst = [loop.run(s.gateway.open(req)) for _ in range(4)]
        start = burst[0]._start(burst[0].replica).start
        assert start.disabled_reason == common_pb2.DISABLED_REASON_DYNAMIC_K, start
        for g in burst:
            g.close()
    finally:
        s.close()


def test_a_stream_opening_beside_unanswered_ones_starts_plain(loop, model, smollm2_dir):
    """A burst's requests open one by one, each counting the requests admitted so far,
    and prefill together: a stream opening while others on its replica have had no
    response yet starts plain (BatchK chooses its K from its first response, the batch
    known). Streams that have answered, or are gone, do not count."""
    # Drafting pays at any batch.
    s, req = first_k_stack(loop, model, smollm2_dir, at_16=(20, 20.5, 21, 22))
    try:
        burst = [loop.run(s.gateway.open(req)) for _ in range(3)]
        for g in burst:
            loop.run(g.start())
        assert [g.enabled for g in burst] == [True, False, False]
        deltas = burst[0].deltas()
        loop.run(deltas.__anext__())  # the first one's first response
        for g in burst[1:]:
            g.close()
        late = loop.run(s.gateway.open(req))
        loop.run(late.start())
        assert late.enabled and late.num_speculative_tokens == 4
        late.close()
        loop.run(deltas.aclose())
        assert not burst[0].replica.unanswered
    finally:
        s.close()


def test_a_stream_joining_a_batch_that_runs_plain_starts_plain(loop, model, smollm2_dir):
    """Where the replica's batch last chose plain decoding for every stream on it, a new
    stream starts plain too, whatever it would choose alone (opened with its own K, it
    drafted one step alone, its drafter taking in its whole prompt, before the batch's
    choice reached it); with that batch gone, it opens with its own K."""
    # At the prior's 0.9 a position drafting pays at any batch; a request's own
    # evidence soon outweighs the prior.
    s, req = first_k_stack(loop, model, smollm2_dir, at_16=(20, 24, 28, 36),
                           dynamic_k_prior_steps=1)
    try:
        first = loop.run(s.gateway.open(req))
        loop.run(first.start())
        deltas = first.deltas()
        loop.run(deltas.__anext__())  # its first response: the batch is known
        for _ in range(20):  # its drafts are never accepted
            first.dynamic.observe(4, 0)
        # The batch's choice at a step of 16 sequences: plain.
        assert first.dynamic.next_k(16, step=10**6) == 0
        late = loop.run(s.gateway.open(req))
        loop.run(late.start())
        assert late.dynamic.next_k(2) == 4  # alone it would draft
        assert not late.enabled and late.num_speculative_tokens == 0
        late.close()
        loop.run(deltas.aclose())
        first.close()
        again = loop.run(s.gateway.open(req))
        loop.run(again.start())  # the plain batch is gone
        assert again.enabled and again.num_speculative_tokens == 4
        again.close()
    finally:
        s.close()


class EndsAtFirstUpdate:
    """A Generate call whose first policy update finds the stream ended, as when the
    verifier finishes the request while the update is on its way: the write fails
    and every read after it reports the failure (grpc.aio does both)."""

    def __init__(self, call):
        self.call, self.error, self.updates = call, None, 0

    async def write(self, msg):
        if msg.WhichOneof("kind") == "policy_update":
            self.updates += 1
            if self.error is None:
                self.call.cancel()
                self.error = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(),
                                                  grpc.aio.Metadata(), "Internal error from Core")
        if self.error is not None:
            raise self.error
        await self.call.write(msg)

    async def read(self):
        if self.error is not None:
            raise self.error
        return await self.call.read()

    def cancel(self):
        return self.call.cancel()


def test_a_policy_update_that_finds_its_stream_ended_loses_no_text(loop, model, smollm2_dir):
    """The response before a failed update still reaches the client, and the request
    goes on from there on the same replica, which stays healthy: the reply is the
    target's, whole. (The response was lost with the update's failure, and the replica
    taken for failed: replies missing a token in the middle.)"""
    # K starts at 8 and falls to 1 within the request (test_k_changes_during_one_request).
    s = GatewayStack(loop, model, smollm2_dir, drafters={"draft_model": FirstRightDrafter(model)},
                     profile=OPTIMISTIC, dynamic_k_prior_steps=1)
    req = GenerationRequest(prompt_token_ids=tuple(s.chat_ids("Count to twenty.")),
                            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=24),
                            speculative=SpeculativeRequest(method="draft_model", auto=True))
    try:
        g = loop.run(s.gateway.open(req))
        loop.run(g.start())
        replica, call = g._opened
        wrapped = EndsAtFirstUpdate(call)
        g._opened = (replica, wrapped)

        async def text():
            return "".join([d.text async for d in g.deltas()])

        got = loop.run(text())
        assert wrapped.updates == 1  # an update was written, and failed
        assert got == s.reference(list(req.prompt_token_ids), 24)[0]
        assert replica.healthy and not replica.error
        metrics = httpx2.get(s.base_url.removesuffix("/v1") + "/metrics").text
        assert "specdec_requests_resumed_total 1.0" in metrics
    finally:
        s.close()


def test_auto_and_default_requests_use_the_online_model_without_a_profile(
        loop, model, smollm2_dir):
    """No profile file: "auto" is accepted, and a request that does not choose K gets
    dynamic K from the step times this gateway has measured, so a drafter right only
    at the first position ends at K = 1 where static K would keep the default 4."""
    drafter = FirstRightDrafter(model)
    s = GatewayStack(loop, model, smollm2_dir, drafters={"draft_model": drafter},
                     default_method="draft_model", dynamic_k_prior_steps=1)
    try:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)

        def chat(content, max_tokens, speculative=None):
            extra = {} if speculative is None else {"speculative": speculative}
            return client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": content}],
                temperature=0, max_tokens=max_tokens, extra_body=extra)

        # Plain steps to learn from: the model has no profile before MIN_STEPS of them.
        online = s.gateway.online_profile
        while online.num_steps < MIN_STEPS:
            chat("Say something.", 30, {"method": "none"})
        # "auto" without a profile file is accepted (it used to be a 400).
        resp = chat("Name three colours.", 12, {"num_speculative_tokens": "auto"})
        assert resp.choices[0].message.content == s.reference(s.chat_ids("Name three colours."),
                                                              12)[0]
        drafter.wanted.clear()
        content = "Count to twenty."
        resp = chat(content, 40)  # no speculative field: the deployment's default
        assert resp.choices[0].message.content == s.reference(s.chat_ids(content), 40)[0]
        asked = [k for k in drafter.wanted if k]
        spec = resp.model_extra["spec_decode"]
        if spec["num_drafts"] == 0:
            # The measured drafter wait outweighs what drafting saves: plain from the start.
            assert asked == [] and spec["disabled_reason"] == "dynamic_k", (asked, spec)
        else:
            # Within the default K; once its own rates show only position 1 is ever
            # accepted, no K above 1 is worth its rows: it drops to K = 1, or to plain
            # where the measured drafter wait outweighs position 1 (which of the two
            # depends on the step times measured). Static K would ask 4 throughout,
            # about 20 times in 40 tokens.
            assert max(asked) <= 4, (asked, spec)
            assert sum(1 for k in asked if k > 1) <= 4, (asked, spec, online.cost())
            assert max(asked[4:], default=0) <= 1, (asked, spec, online.cost())
        text = httpx2.get(s.base_url.removesuffix("/v1") + "/metrics").text
        assert all(f"specdec_step_cost_{c}_ms" in text for c in "abgw")
        assert 'specdec_step_cost_forward_ms{rows="16"}' in text
        assert 'specdec_step_cost_draft_ms{method="draft_model"}' in text
    finally:
        s.close()


def test_auto_drafts_the_default_k_until_the_online_model_has_a_profile(
        loop, model, smollm2_dir):
    """A fresh gateway has no step times: an "auto" request, bounded by the verifier's
    maximum (8), drafts the deployment's default K (4) until there is a profile,
    rather than 8 for everyone."""
    drafter = FirstRightDrafter(model)
    s = GatewayStack(loop, model, smollm2_dir, drafters={"draft_model": drafter})
    try:
        auto_chat(s, "draft_model", 12)
        assert s.gateway.online_profile.num_steps < MIN_STEPS  # no profile all along
        asked = [k for k in drafter.wanted if k]
        # 4 every step; the last may be cut shorter by max_tokens.
        assert asked[0] == 4 and max(asked) == 4 and len(asked) >= 3, asked
    finally:
        s.close()


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
        assert s.gateway.online_profile.num_steps >= MIN_STEPS
        asked = [k for k in drafter.wanted if k]
        # K = 4 every step but a request's last, which max_tokens may cut shorter.
        assert max(asked) == 4 and sum(k != 4 for k in asked) <= 3, asked
    finally:
        s.close()


def test_profile_command_measures_a_running_verifier(loop, model, smollm2_dir, tmp_path):
    s = GatewayStack(loop, model, smollm2_dir)
    try:
        prompts = [s.chat_ids(t) for t in ("one two three", "red green blue", "alpha beta")]
        result = asyncio.run(profile(s.replicas[0].address, prompts, [1, 3], [0, 2, 4], 10,
                                     "draft_model", log=lambda _: None))
        assert result.batch_sizes == (1, 3) and result.ks == (0, 2, 4)
        assert all(v > 0 for row in result.itl_ms for v in row)
        # The oracle drafter's drafts are all accepted; ngram on random text rarely is.
        assert result.acceptance["draft_model"] == (1.0,) * 4
        assert set(result.acceptance) == {"ngram", "draft_model"}
        # The oracle always has drafts; ngram has none where the text has no match.
        assert result.availability["draft_model"] == 1.0
        assert set(result.availability) == {"ngram", "draft_model"}
        assert 0.0 <= result.availability["ngram"] <= 1.0
        assert result.method_itl_ms == {}  # one method: the shared table only
        path = tmp_path / "profile.json"
        result.save(path)
        assert ItlProfile.load(path) == result
    finally:
        s.close()


def test_profile_command_measures_each_method(loop, model, smollm2_dir, tmp_path):
    s = GatewayStack(loop, model, smollm2_dir)
    try:
        prompts = [s.chat_ids(t) for t in ("one two three", "red green blue")]
        logged: list[str] = []
        result = asyncio.run(profile(s.replicas[0].address, prompts, [1, 2], [0, 2, 3], 8,
                                     ["draft_model", "ngram", "draft_model"],
                                     log=logged.append))
        assert result.batch_sizes == (1, 2) and result.ks == (0, 2, 3)
        # The first method's table is the shared one; each further method has its own.
        assert set(result.method_itl_ms) == {"ngram"}
        own = result.method_itl_ms["ngram"]
        assert len(own) == 2 and all(len(row) == 3 and all(v > 0 for v in row) for row in own)
        # K=0 drafts nothing: measured once per batch size and shared by both tables.
        assert [row[0] for row in own] == [row[0] for row in result.itl_ms]
        assert sum(" K 0:" in line for line in logged) == 2
        assert sum(" K 2 ngram:" in line for line in logged) == 2
        assert sum(" K 2 draft_model:" in line for line in logged) == 2
        assert result.itl(2, 3, "ngram") == own[1][2]
        assert result.itl(2, 3, "draft_model") == result.itl(2, 3) == result.itl_ms[1][2]
        path = tmp_path / "profile.json"
        result.save(path)
        assert ItlProfile.load(path) == result
        with pytest.raises(SystemExit, match="--method eagle3: the verifier has no such drafter"):
            asyncio.run(profile(s.replicas[0].address, prompts, [1], [0, 2], 4,
                                ["ngram", "eagle3"], log=lambda _: None))
    finally:
        s.close()


def test_profile_cli_method_takes_a_comma_separated_list(capsys):
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).method is None
    assert p.parse_args(["--method", "ngram"]).method == ["ngram"]
    assert p.parse_args(["--method", "ngram, eagle3,"]).method == ["ngram", "eagle3"]
    with pytest.raises(SystemExit):
        p.parse_args(["--method", ","])
    assert "--method: expected one or more method names" in capsys.readouterr().err


def test_gateway_cli_dynamic_k_flag():
    from gateway.__main__ import build_parser

    p = build_parser()
    assert p.parse_args([]).dynamic_k is True
    assert p.parse_args(["--no-dynamic-k"]).dynamic_k is False
    assert p.parse_args(["--num-speculative-tokens", "3"]).num_speculative_tokens == 3


class OracleNgram(OracleDraftModel):
    """The target's own continuation (every draft accepted), posing as an ngram
    drafter; records the K asked for at every step."""

    name = "ngram"

    def __init__(self, model):
        super().__init__(model)
        self.wanted: list[int] = []

    def info(self) -> DrafterInfo:
        return DrafterInfo(method=common_pb2.SPEC_METHOD_NGRAM,
                           vocab_size=self.model.config.vocab_size,
                           max_num_speculative_tokens=K_MAX)

    def propose(self, wanted):
        self.wanted.extend(wanted.values())
        return super().propose(wanted)


class FirstRightNgram(OracleNgram):
    """As OracleNgram, but only its first draft token is right (FirstRightDrafter)."""

    def draft(self, ctx, k):
        return FirstRightDrafter.draft(self, ctx, k)


def test_k_by_outcome_reaches_the_verifier_and_sets_k_there(loop, model, smollm2_dir):
    """ngram under dynamic K on a verifier that takes tables: the gateway sends its K
    with a table, and the verifier applies it itself. Every draft of an oracle is
    accepted, so from then on each step asks the table's K after all accepted."""
    drafter = OracleNgram(model)
    prof = ItlProfile(batch_sizes=(1, 16), ks=(0, 1, 2, 4, 8),
                      itl_ms=((10, 10.5, 11, 30, 60), (20, 21, 22, 60, 120)),
                      acceptance={"ngram": (0.95,)})
    s = GatewayStack(loop, model, smollm2_dir, drafters={"ngram": drafter}, profile=prof,
                     dynamic_k_prior_steps=1)
    worker = s.replicas[0].servicer.worker
    sent: list[tuple[int, tuple | None]] = []
    set_k = worker.set_num_speculative_tokens

    def record(request_id, k, k_by_outcome=None, auto_k=False):
        sent.append((k, k_by_outcome))
        set_k(request_id, k, k_by_outcome, auto_k)

    worker.set_num_speculative_tokens = record
    try:
        assert s.replicas[0].load().k_by_outcome_supported
        resp = auto_chat(s, "ngram", 60)
        tables = [(k, t) for k, t in sent if t is not None]
        assert tables, sent
        # A level's table, sent with its K after some accepted (the level).
        assert all(t == table_of_level(k, K_MAX) for k, t in tables), tables
        tables = [t for _, t in tables]
        asked = [k for k in drafter.wanted if k]
        # After the last table, every step asks its K after all accepted (the last
        # steps may ask less, cut by max_tokens).
        assert asked.count(tables[-1][DraftOutcome.ALL_ACCEPTED]) >= 3, (asked, sent)
        spec = resp.model_extra["spec_decode"]
        assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
    finally:
        s.close()


def test_a_batchs_table_is_chosen_again_only_every_few_steps(loop, model, smollm2_dir,
                                                             monkeypatch):
    """Choosing a table costs the gateway's CPU, on a small machine the verifier's: a
    batch keeps its table for TABLE_REFRESH_STEPS steps, then chooses again."""
    import gateway.generation as generation

    chosen_at: list[int] = []
    choose = generation.choose_table

    def counted(*args, **kwargs):
        chosen_at.append(len(drafter.wanted))
        return choose(*args, **kwargs)

    monkeypatch.setattr(generation, "choose_table", counted)
    drafter = FirstRightNgram(model)  # one draft accepted a step: many steps
    prof = ItlProfile(batch_sizes=(1, 16), ks=(0, 1, 2, 4, 8),
                      itl_ms=((10, 10.5, 11, 12, 14), (20, 21, 22, 24, 28)),
                      acceptance={"ngram": (0.95,)})
    s = GatewayStack(loop, model, smollm2_dir, drafters={"ngram": drafter}, profile=prof,
                     dynamic_k_prior_steps=1)
    try:
        auto_chat(s, "ngram", 60)
        steps = len(drafter.wanted)
        assert steps > 2 * TABLE_REFRESH_STEPS, steps
        # Chosen at the first step, then once every TABLE_REFRESH_STEPS steps.
        assert 2 <= len(chosen_at) <= steps // TABLE_REFRESH_STEPS + 1, (chosen_at, steps)
        assert all(b - a >= TABLE_REFRESH_STEPS - 1 for a, b in itertools.pairwise(chosen_at)), \
            chosen_at
    finally:
        s.close()


def test_a_verifier_that_chooses_k_itself_gets_the_bound_and_no_updates(loop, model,
                                                                        smollm2_dir):
    """--speculation-control verifier: the gateway opens a dynamic-K stream with the
    request's bound and auto_k, and sends no PolicyUpdate of K, through one gateway or
    two (the verifier sees the step's batch whatever sent it); the verifier's engine
    chooses K within the bound each step, and the text is the target's."""
    from gateway.core import Gateway, GatewayConfig
    from gateway.replicas import ReplicaPool
    from gateway.service import serve as serve_gateway
    from tests.verifier.test_speculation import MadeUpCost

    drafter = FirstRightDrafter(model)
    s = GatewayStack(loop, model, smollm2_dir, drafters={"draft_model": drafter},
                     speculation_controller=True)
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
