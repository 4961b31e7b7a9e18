"""Dynamic K end to end: the profile command measures a running verifier, and
a request's K changes mid-request once its own acceptance replaces the prior."""

from __future__ import annotations

import argparse
import asyncio

import httpx2
import openai
import pytest

from gateway.policy.itl_profile import ItlProfile
from gateway.profile import add_arguments, profile
from tests.gateway.stack import MODEL_NAME, GatewayStack, OracleDraftModel


class FirstRightDrafter(OracleDraftModel):
    """Only the first draft token is right; records the K asked for at every step."""

    def __init__(self, model):
        super().__init__(model)
        self.wanted: list[int] = []

    def propose(self, wanted):
        self.wanted.extend(wanted.values())
        return super().propose(wanted)

    def draft(self, ctx, k):
        first = super().draft(ctx, 1)
        # Wrong on purpose: the target's greedy token is never its predecessor + 1 twice.
        return first + [(first[0] + 1 + i) % self.model.config.vocab_size for i in range(k - 1)]


def test_k_changes_during_one_request(loop, model, smollm2_dir):
    drafter = FirstRightDrafter(model)
    # Mild step cost and an optimistic prior: K starts at the deployment's maximum (8).
    # Once this request's own rates show that only position 1 is ever accepted, AL is the
    # same for every K >= 1, and the cheapest of those, K = 1, has the best goodput.
    prof = ItlProfile(batch_sizes=(1, 16), ks=(0, 1, 2, 4, 6, 8),
                      itl_ms=((10, 11, 12, 14, 16, 18), (20, 22, 24, 28, 32, 36)),
                      acceptance={"draft_model": (0.9,)})
    s = GatewayStack(loop, model, smollm2_dir, drafters={"draft_model": drafter},
                     profile=prof, dynamic_k_warmup_steps=3)
    try:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        content = "Count to twenty."
        want, _ = s.reference(s.chat_ids(content), 40)
        resp = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": content}], temperature=0,
            max_tokens=40, extra_body={"speculative": {"method": "draft_model",
                                                       "num_speculative_tokens": "auto"}})
        assert resp.choices[0].message.content == want
        asked = [k for k in drafter.wanted if k]
        assert asked[0] == 8, asked
        assert asked[-1] == 1 and asked.count(1) >= 5, asked
        spec = resp.model_extra["spec_decode"]
        # After the switch every draft token is accepted (only the right one is asked for).
        assert spec["num_accepted_tokens"] > spec["num_drafts"] * 0.5
        text = httpx2.get(s.base_url.removesuffix("/v1") + "/metrics").text
        assert "specdec_spec_decode_k_updates_total 1.0" in text
    finally:
        s.close()


def test_auto_without_profile_is_a_clear_error(loop, model, smollm2_dir):
    s = GatewayStack(loop, model, smollm2_dir, drafters={})
    try:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="specdec profile"):
            client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                extra_body={"speculative": {"method": "ngram", "num_speculative_tokens": "auto"}})
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
