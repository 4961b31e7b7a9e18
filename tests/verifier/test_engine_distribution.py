"""Engine-level losslessness: through the whole engine (scheduler, paged KV,
one ragged forward, rejection sampler, rollback), sampled tokens follow the
target model's distribution, with one-hot drafts and with drafts that carry
their probabilities.

The engine samples a request's first token at the end of its prefill, with
no drafts; drafts are verified from the second token on. So each request
asks for K = 2 drafts and max_tokens = 4 (the scheduler caps K at
max_tokens - 1 - generated, so the first verify step gets both drafts), and
the test checks the joint law of the first three tokens x1, x2, x3: x1 from
the prefill row, x2 and x3 from the first verify block (accepted drafts,
recovered tokens, the bonus token) or, after an early rejection, from a
K = 1 step. The exact law comes from the float64 model itself:
p(x1 | prompt) p(x2 | prompt, x1) p(x3 | prompt, x1, x2), filtered as the
request asks.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from bench.stats import chi_square_p_value
from specdec.models import LlamaForCausalLM
from specdec.processors import LogitsProcessors
from specdec.sampling import SamplingParams
from tests.tiny import next_token_logits, tiny_llama
from tests.verifier.test_processors import by_hand
from tests.verifier.test_rejection import filtered_table
from verifier.engine import Engine, EngineConfig, Proposal, Proposer, Request

VOCAB = 8  # x1, x2, x3 make VOCAB**3 = 512 cells per prompt
K = 2
NUM_TOKENS = 3  # tokens whose joint law is checked
NUM_PROMPTS = 4
NUM_REQUESTS = 20_000
P_MIN = 1e-3


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny tensors: a second thread only adds synchronisation, and on a busy
    # 2-core machine it makes these steps ten times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    # logit_scale 2: entropy ~1.7 nats of 2.1, so top-k and top-p cut real mass.
    return tiny_llama(VOCAB, seed=0, max_len=64, logit_scale=2.0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(NUM_PROMPTS)]


def draft_table() -> torch.Tensor:
    """q[prev] [V, V]: a skewed draft distribution given the previous token,
    unrelated to the target (with q sent along, a draft is accepted 35-45%
    of the time, so every accept/reject path runs often)."""
    gen = torch.Generator().manual_seed(42)
    return (torch.randn(VOCAB, VOCAB, generator=gen, dtype=torch.float64) * 1.5).softmax(-1)


class MarkovDrafter(Proposer):
    """Drafts each token from q[previous token] with its own RNG; with_probs
    sends those q rows along, else the drafts are one-hot."""

    def __init__(self, q: torch.Tensor, with_probs: bool, seed: int):
        self.q = q
        self.with_probs = with_probs
        self.gen = torch.Generator().manual_seed(seed)

    def start(self, seq_id, request):
        pass

    def propose(self, wanted, tokens):
        out = {}
        for seq_id, k in wanted.items():
            prev, draft = tokens[seq_id][-1], []
            for _ in range(k):
                prev = int(torch.multinomial(self.q[prev], 1, generator=self.gen))
                draft.append(prev)
            rows = self.q[[tokens[seq_id][-1], *draft[:-1]]] if self.with_probs else None
            out[seq_id] = Proposal(draft, rows)
        return out

    def advance(self, seq_id, outcome):
        pass

    def free(self, seq_id):
        pass


def target_law(model: LlamaForCausalLM, prompt: list[int], params: SamplingParams,
               processors: LogitsProcessors | None = None) -> torch.Tensor:
    """[V, V, V] float64: p(x1, x2, x3 | prompt) after the request's logits processors
    (each context's output so far is what it adds to the prompt) and filters."""
    v = range(VOCAB)
    contexts = [prompt] + [prompt + [a] for a in v] + [prompt + [a, b] for a in v for b in v]
    logits = next_token_logits(model, contexts)
    if processors is not None:
        logits = torch.stack([by_hand(row, processors, prompt, c[len(prompt):], set())
                              for row, c in zip(logits, contexts, strict=True)])
    table = filtered_table(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    p1, p2, p3 = table[0], table[1:1 + VOCAB], table[1 + VOCAB:].view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def cell_counts(prompt_index: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """prompt_index [N], tokens [N, 3] -> counts [NUM_PROMPTS, V**3]."""
    cell = ((prompt_index * VOCAB + tokens[:, 0]) * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    return torch.bincount(cell, minlength=NUM_PROMPTS * VOCAB**3).view(NUM_PROMPTS, -1)


def run_engine(model, prompts, params: SamplingParams, with_probs: bool, processors=None,
               grammar=None):
    """Returns prompt index [N], the first three tokens [N, 3], and the
    accepted counts seen in steps that verified K = 2 drafts. grammar: a callable
    giving each request a fresh GrammarState."""
    engine = Engine(
        model,
        EngineConfig(max_num_seqs=512, max_model_len=32, block_size=16, num_kv_blocks=1024,
                     max_num_batched_tokens=8192, max_num_speculative_tokens=K, seed=2024),
        MarkovDrafter(draft_table(), with_probs, seed=7),
    )
    for i in range(NUM_REQUESTS):
        engine.add_request(Request(f"r{i}", prompts[i % NUM_PROMPTS], NUM_TOKENS + 1, params,
                                   ignore_eos=True, num_speculative_tokens=K,
                                   processors=processors,
                                   grammar=grammar() if grammar is not None else None))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(NUM_REQUESTS)}
    accepted_at_k2: set[int] = set()
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.num_drafted == K:
                accepted_at_k2.add(o.num_accepted)
    tokens = torch.tensor([out[f"r{i}"][:NUM_TOKENS] for i in range(NUM_REQUESTS)])
    return torch.arange(NUM_REQUESTS) % NUM_PROMPTS, tokens, accepted_at_k2


SAMPLING = {
    "plain": SamplingParams(temperature=1.0),
    "t0.8_topk5": SamplingParams(temperature=0.8, top_k=5),
    "topp0.9": SamplingParams(top_p=0.9),
}


@pytest.mark.parametrize("with_probs", [False, True], ids=["one_hot", "draft_probs"])
@pytest.mark.parametrize("name", list(SAMPLING))
def test_first_tokens_follow_the_target(model, prompts, name, with_probs):
    params = SAMPLING[name]
    prompt_index, tokens, accepted_at_k2 = run_engine(model, prompts, params, with_probs)
    law = torch.stack([target_law(model, p, params).reshape(-1) for p in prompts])  # [G, V**3]
    expected = law * (NUM_REQUESTS // NUM_PROMPTS)
    p_value = chi_square_p_value(cell_counts(prompt_index, tokens), expected)
    assert p_value > P_MIN, f"{name}: p-value {p_value:.2e}"
    # Both drafts accepted, the second rejected, the first rejected: all paths ran.
    assert accepted_at_k2 == {0, 1, 2}


# Penalties that move every row by what the drafts before it add, a bias, and a mask.
PROCESSORS = LogitsProcessors(presence_penalty=0.6, frequency_penalty=0.4,
                              repetition_penalty=1.5, logit_bias=((3, 1.0),),
                              allowed_token_ids=(0, 1, 2, 3, 4, 5, 7))


@pytest.mark.parametrize("with_probs", [False, True], ids=["one_hot", "draft_probs"])
def test_first_tokens_follow_the_processed_target(model, prompts, with_probs):
    """Logits processors under speculation: row j counts drafts 1..j as output, so the
    law of x2 and x3 is the processed target's given x1 (and x2), token 6 never comes."""
    params = SAMPLING["t0.8_topk5"]
    prompt_index, tokens, accepted_at_k2 = run_engine(model, prompts, params, with_probs,
                                                      PROCESSORS)
    law = torch.stack([target_law(model, p, params, PROCESSORS).reshape(-1) for p in prompts])
    p_value = chi_square_p_value(cell_counts(prompt_index, tokens),
                                 law * (NUM_REQUESTS // NUM_PROMPTS))
    assert p_value > P_MIN, f"p-value {p_value:.2e}"
    assert accepted_at_k2 == {0, 1, 2}
    assert not (tokens == 6).any()
    # The processors matter: the unprocessed law would fail the same check.
    plain = torch.stack([target_law(model, p, params).reshape(-1) for p in prompts])
    assert chi_square_p_value(cell_counts(prompt_index, tokens),
                              plain * (NUM_REQUESTS // NUM_PROMPTS)) < P_MIN


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("with_probs", [False, True], ids=["one_hot", "draft_probs"])
def test_first_tokens_follow_the_target_on_cuda(model, prompts, with_probs):
    """The same law on a GPU: CUDA graphs for the verify steps, the Triton
    sampler, device generators."""
    params = SAMPLING["t0.8_topk5"]
    cuda_model = copy.deepcopy(model).to("cuda")
    prompt_index, tokens, accepted_at_k2 = run_engine(cuda_model, prompts, params, with_probs)
    law = torch.stack([target_law(model, p, params).reshape(-1) for p in prompts])
    p_value = chi_square_p_value(cell_counts(prompt_index, tokens),
                                 law * (NUM_REQUESTS // NUM_PROMPTS))
    assert p_value > P_MIN, f"p-value {p_value:.2e}"
    assert accepted_at_k2 == {0, 1, 2}


def test_the_check_rejects_a_wrong_law(model, prompts):
    """Negative control: the same check passes exact samples from p and fails
    tokens that an engine accepting every draft would emit (x1 ~ p, then
    x2 ~ q[x1], x3 ~ q[x2])."""
    gen = torch.Generator().manual_seed(3)
    q = draft_table()
    law = torch.stack([target_law(model, p, SAMPLING["plain"]).reshape(-1) for p in prompts])
    n = NUM_REQUESTS // NUM_PROMPTS
    prompt_index = torch.arange(NUM_PROMPTS).repeat_interleave(n)
    cells = torch.cat([torch.multinomial(row, n, replacement=True, generator=gen) for row in law])
    exact = torch.stack([cells // VOCAB**2, cells // VOCAB % VOCAB, cells % VOCAB], dim=1)
    assert chi_square_p_value(cell_counts(prompt_index, exact), law * n) > P_MIN

    x2 = torch.multinomial(q[exact[:, 0]], 1, generator=gen)[:, 0]
    x3 = torch.multinomial(q[x2], 1, generator=gen)[:, 0]
    all_accepted = torch.stack([exact[:, 0], x2, x3], dim=1)
    assert chi_square_p_value(cell_counts(prompt_index, all_accepted), law * n) < P_MIN


# A grammar over the tokens a..h (ids 0..7) whose mask at x2 depends on x1 and at x3
# cuts half the vocabulary; after "h" it allows "e" alone, which the verifier then
# drafts itself (grammar text as free drafts) after the drafter's cut drafts.
GRAMMAR_REGEX = r"([a-d][e-h]|[e-g][a-d]|he)[aceg][a-h]"


def grammar_allowed(output: list[int]) -> list[int]:
    """The tokens GRAMMAR_REGEX allows after `output`, written out by hand."""
    if not output:
        return list(range(VOCAB))
    if len(output) == 1:
        x1 = output[0]
        return [4] if x1 == 7 else list(range(4, 8)) if x1 < 4 else list(range(4))
    if len(output) == 2:
        return [0, 2, 4, 6]
    return list(range(VOCAB))


def masked_law(model: LlamaForCausalLM, prompt: list[int], params: SamplingParams
               ) -> torch.Tensor:
    """[V, V, V] float64: p(x1, x2, x3 | prompt) with each row masked to what the
    grammar allows after its context's output, then filtered."""
    v = range(VOCAB)
    outputs = [[]] + [[a] for a in v] + [[a, b] for a in v for b in v]
    logits = next_token_logits(model, [prompt + o for o in outputs]).clone()
    for row, out in zip(logits, outputs, strict=True):
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[grammar_allowed(out)] = True
        row[~keep] = float("-inf")
    table = filtered_table(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    p1, p2, p3 = table[0], table[1:1 + VOCAB], table[1 + VOCAB:].view(VOCAB, VOCAB, VOCAB)
    return (p1[:, None, None] * p2[:, :, None] * p3).nan_to_num(0.0)


@pytest.mark.parametrize("with_probs", [False, True], ids=["one_hot", "draft_probs"])
def test_first_tokens_follow_the_target_under_a_grammar_mask(model, prompts, with_probs):
    """A grammar under speculation: drafts it forbids are cut, row j is masked to the
    grammar's state after drafts 1..j, its forced text joins as drafts; the law of
    x1..x3 is the masked target's."""
    import xgrammar as xgr

    from specdec.structured import GrammarState

    info = xgr.TokenizerInfo([chr(ord("a") + i) for i in range(VOCAB)])
    compiled = xgr.GrammarCompiler(info).compile_regex(GRAMMAR_REGEX)

    def grammar() -> GrammarState:
        return GrammarState(xgr, compiled, VOCAB, encode=lambda text: [ord(c) - ord("a")
                                                                        for c in text])

    params = SAMPLING["t0.8_topk5"]
    prompt_index, tokens, _ = run_engine(model, prompts, params, with_probs, grammar=grammar)
    law = torch.stack([masked_law(model, p, params).reshape(-1) for p in prompts])
    counts = cell_counts(prompt_index, tokens)
    p_value = chi_square_p_value(counts, law * (NUM_REQUESTS // NUM_PROMPTS))
    assert p_value > P_MIN, f"p-value {p_value:.2e}"
    assert all(int(t[1]) in grammar_allowed([int(t[0])]) for t in tokens)
    assert not ((tokens[:, 2] % 2) == 1).any()  # x3 in a, c, e, g
    # The mask matters: the unmasked law fails the same check.
    plain = torch.stack([target_law(model, p, params).reshape(-1) for p in prompts])
    assert chi_square_p_value(counts, plain * (NUM_REQUESTS // NUM_PROMPTS)) < P_MIN
