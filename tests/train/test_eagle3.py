"""EAGLE-3 training (train/eagle3.py) on a tiny random target: the unrolled
training forward computes what the drafting head computes, the loss goes down, and
the checkpoint it writes loads and drafts over the most frequent tokens."""

from __future__ import annotations

import json
import random
from collections import Counter

import torch

from drafter.heads.load import load_head
from specdec.models import load_model
from tests.drafter.test_eagle import VOCAB, H, make_target
from train import eagle3

LAYERS = (2, 4, 5)  # the default for the 8-layer test target


def write_data(path, n=12, seed=0) -> list[dict]:
    """Prompt + reply rows whose replies favour a few tokens, so frequencies are distinct."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        prompt = torch.randint(VOCAB, (6,), generator=g).tolist()
        reply = (torch.randint(12, (14,), generator=g) ** 2 % VOCAB).tolist()
        rows.append({"prompt": prompt, "reply": reply})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_unrolled_forward_matches_the_drafting_head(tmp_path):
    target_dir = tmp_path / "target"
    make_target(target_dir)
    target = load_model(target_dir, dtype="float64")
    tokens = torch.randint(VOCAB, (9,), generator=torch.Generator().manual_seed(1))
    hidden = eagle3.target_features(target, tokens, LAYERS).double()
    head = eagle3.build_head(target, torch.arange(0, VOCAB, 2), 48, LAYERS, seed=0).double()
    with torch.no_grad():
        for p in head.parameters():  # norms away from 1, so that every weight shows
            p.add_(0.05 * torch.randn_like(p))
        outs = eagle3.unrolled_forward(head, tokens, hidden, steps=3)

        # Drafting as drafter/eagle.py does: rows 0..i in the head cache, then one row
        # per step fed with the previous step's output and the true next token.
        i = 4
        cache = head.make_kv_cache(8, 4)
        cache.add(0)
        meta = cache.plan([(0, i + 1)])
        out = head(tokens[1:i + 2], head.features(hidden[:i + 1]), torch.arange(i + 1), meta, cache)
        h = out[-1:]
        torch.testing.assert_close(h[0], outs[0][i])
        for j in (2, 3):
            meta = cache.plan([(0, 1)])
            h = head(tokens[i + j: i + j + 1], h, torch.tensor([i + j - 1]), meta, cache)
            torch.testing.assert_close(h[0], outs[j - 1][i])


def test_training_writes_a_loadable_head_and_learns(tmp_path):
    target_dir = tmp_path / "target"
    make_target(target_dir)
    rows = write_data(tmp_path / "data.jsonl")
    target = load_model(target_dir, dtype="float32")
    examples = eagle3.load_examples(tmp_path / "data.jsonl", max_len=64)
    eagle3.attach_features(target, examples, LAYERS, store=None)

    # The draft vocabulary is the most frequent tokens; d2t maps back to them.
    dv = 16
    draft_ids = eagle3.draft_vocabulary(examples, dv, VOCAB)
    counts = Counter(t for r in rows for t in r["prompt"] + r["reply"])
    least = min(counts[t] for t in draft_ids.tolist())
    assert all(c <= least for t, c in counts.items() if t not in set(draft_ids.tolist()))
    t2d = eagle3.target_to_draft(draft_ids, VOCAB)
    assert (t2d[draft_ids] == torch.arange(dv)).all()

    # The loss falls on a repeated small batch.
    head = eagle3.build_head(target, draft_ids, 64, LAYERS, seed=0)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    batch = examples[:3]
    losses = []
    for _ in range(25):
        opt.zero_grad()
        loss = sum(eagle3.sequence_loss(head, ex, t2d, 2, [1.0, 0.8])[0] for ex in batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]

    # The script end to end: a checkpoint that load_head takes, of the size it reports.
    out = tmp_path / "head"
    result = eagle3.train(eagle3.build_parser().parse_args([
        "--data", str(tmp_path / "data.jsonl"), "--out", str(out), "--target", str(target_dir),
        "--minutes", "1", "--max-steps", "4", "--draft-vocab", str(dv),
        "--intermediate-size", "64", "--batch", "2", "--no-cache", "--eval-fraction", "0.2"]))
    assert result["steps"] == 4
    assert result["weights_bytes"] == (out / eagle3.WEIGHTS_FILE).stat().st_size
    loaded = load_head("eagle3", out, target_dir, dtype="float32")
    assert loaded.config.draft_vocab_size == dv
    assert loaded.config.target_layers == LAYERS
    assert loaded.config.decoder.intermediate_size == 64
    mapped = torch.arange(dv) + loaded.d2t
    train_split = eagle3.load_examples(tmp_path / "data.jsonl", max_len=64)
    random.Random(0).shuffle(train_split)  # as train() splits with --seed 0
    expected = eagle3.draft_vocabulary(train_split[result["held_out"]:], dv, VOCAB)
    assert set(mapped.tolist()) == set(expected.tolist())
    assert loaded.lm_head.weight.dtype == torch.float32


def test_held_out_rows_come_from_every_eval_file(tmp_path):
    target_dir = tmp_path / "target"
    make_target(target_dir)
    write_data(tmp_path / "data.jsonl", n=8)
    write_data(tmp_path / "mixed_heldout.jsonl", n=3, seed=1)
    write_data(tmp_path / "chat_heldout.jsonl", n=2, seed=2)
    out = tmp_path / "head"
    result = eagle3.train(eagle3.build_parser().parse_args([
        "--data", str(tmp_path / "data.jsonl"), "--out", str(out), "--target", str(target_dir),
        "--eval-data", str(tmp_path / "mixed_heldout.jsonl"), str(tmp_path / "chat_heldout.jsonl"),
        "--minutes", "1", "--max-steps", "1", "--draft-vocab", "16", "--intermediate-size", "32",
        "--batch", "2", "--no-cache"]))
    # Every --data row trains and every row of both held-out files scores.
    assert (result["sequences"], result["held_out"]) == (8, 5)
    card = (out / "TRAINING.md").read_text()
    assert "`mixed_heldout.jsonl`, `chat_heldout.jsonl`" in card


def test_card_commands_write_home_paths_from_tilde(monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    assert eagle3.shell_arg("/home/u/.cache/specdec/train/chat.jsonl") == \
        "~/.cache/specdec/train/chat.jsonl"
    assert eagle3.shell_arg("/home/u/my data.jsonl") == "~/'my data.jsonl'"
    assert eagle3.shell_arg("/home/user2/x.jsonl") == "/home/user2/x.jsonl"
    assert eagle3.shell_arg("a b") == "'a b'"


def test_training_goes_on_from_a_saved_head(tmp_path):
    target_dir = tmp_path / "target"
    make_target(target_dir)
    write_data(tmp_path / "data.jsonl", n=16)
    common = ["--data", str(tmp_path / "data.jsonl"), "--target", str(target_dir),
              "--minutes", "1", "--batch", "2", "--no-cache", "--eval-fraction", "0.25"]
    first = tmp_path / "first"
    eagle3.train(eagle3.build_parser().parse_args(
        [*common, "--out", str(first), "--max-steps", "3", "--draft-vocab", "16",
         "--intermediate-size", "64"]))
    start = load_head("eagle3", first, target_dir, dtype="float32")

    second = tmp_path / "second"
    result = eagle3.train(eagle3.build_parser().parse_args(
        [*common, "--out", str(second), "--init", str(first), "--max-steps", "3",
         "--draft-vocab", "8", "--intermediate-size", "32", "--lr", "0.05"]))
    # The saved head's vocabulary and width stay whatever the flags say.
    loaded = load_head("eagle3", second, target_dir, dtype="float32")
    assert torch.equal(loaded.d2t, start.d2t)
    assert loaded.config.decoder.intermediate_size == 64
    # Minute 0 is the starting head as it scores on the held-out rows, and the head
    # written is never worse than that on them.
    assert result["history"][0]["step"] == 0
    score = sum(result["final"]["accuracy"]) / len(result["final"]["accuracy"])
    start_score = sum(result["history"][0]["accuracy"]) / len(result["history"][0]["accuracy"])
    assert score >= start_score
    assert result["steps"] == 3
    assert "went on from the head" in (second / "TRAINING.md").read_text()


def test_soft_labels_are_the_targets_distribution_over_the_draft_vocabulary(tmp_path):
    make_target(tmp_path / "target")
    target = load_model(tmp_path / "target", dtype="float64")
    tokens = torch.randint(VOCAB, (12,), generator=torch.Generator().manual_seed(3))
    layers = eagle3.feature_layers(LAYERS, target.config.num_layers)
    hidden = eagle3.target_features(target, tokens, layers).double()  # [T, 4, H]
    hidden[-2:, 3] = 0  # as data.py records them: the last two rows never computed
    draft_ids = torch.arange(0, VOCAB, 2)
    head = eagle3.build_head(target, draft_ids, 48, LAYERS, seed=0).double()
    t2d = eagle3.target_to_draft(draft_ids, VOCAB)
    ex = eagle3.Example(tokens, 3, hidden)
    rows = target.lm_head.weight[draft_ids].double()
    with torch.no_grad():
        got, _ = eagle3.sequence_loss(head, ex, t2d, 1, [1.0], soft_rows=rows, soft_weight=0.75)

        # Reference: the target's next-token logits at every position, restricted to the
        # draft vocabulary; chain i at step 1 predicts token i + 2 from position i + 1.
        cache = target.make_kv_cache(1, 16)
        cache.add(0)
        meta = cache.plan([(0, len(tokens))])
        logits = target(tokens, meta, cache, logits_indices=torch.arange(len(tokens))).logits
        out = eagle3.unrolled_forward(head, tokens, hidden[:, :3], 1)[0]
        terms = []
        for i in range(len(tokens) - 2):
            label = int(t2d[tokens[i + 2]])
            if i + 2 < ex.prompt_len or label < 0:
                continue
            log_q = head.lm_head(head.norm(out[i])).log_softmax(-1)
            hard = -log_q[label]
            if i + 1 >= len(tokens) - 2:  # no recorded final state: the hard label alone
                terms.append(hard)
                continue
            p = logits[i + 1, draft_ids].softmax(-1)
            terms.append(0.25 * hard - 0.75 * (p * log_q).sum())
    assert len(terms) >= 3
    # The features are float16 (as recorded), the reference's logits float64.
    torch.testing.assert_close(got, torch.stack(terms).mean(), rtol=1e-4, atol=0)
    # Without the final state recorded, soft labels are refused rather than made up.
    short = eagle3.Example(tokens, 3, hidden[:, :3])
    try:
        eagle3.sequence_loss(head, short, t2d, 1, [1.0], soft_rows=rows, soft_weight=0.5)
    except AssertionError as e:
        assert "final hidden state" in str(e)
    else:
        raise AssertionError("soft labels without the final hidden state were accepted")


def test_revocab_keeps_trained_rows_and_maps_new_ones_from_the_target(tmp_path):
    make_target(tmp_path / "target")
    target = load_model(tmp_path / "target", dtype="float64")
    g = torch.Generator().manual_seed(4)
    old_ids = torch.randperm(VOCAB, generator=g)[:72].sort().values
    head = eagle3.build_head(target, old_ids, 48, LAYERS, seed=0).double()
    scaled = target.lm_head.weight.detach() * target.norm.weight.detach()  # [V, H]
    # A head whose rows are an exact linear image of the target's: the map is recovered.
    fit = torch.randn(H, H, generator=g, dtype=torch.float64)
    with torch.no_grad():
        head.lm_head.weight.copy_(scaled[old_ids] @ fit)
        head.lm_head.weight[5] += 1e-5  # a trained row off the map: kept as it is
    before = head.lm_head.weight.detach().clone()
    new_ids = torch.cat([old_ids[:60], torch.tensor(sorted(set(range(VOCAB)) - set(  # 5 stays
        old_ids.tolist())))[:12]]).sort().values
    assert eagle3.revocab(head, scaled, new_ids) == 12
    assert torch.equal(head.d2t + torch.arange(72), new_ids)
    for j, t in enumerate(new_ids.tolist()):
        if t in old_ids.tolist():
            assert torch.equal(head.lm_head.weight[j], before[old_ids.tolist().index(t)])
        else:  # least squares over 72 rows, one of them slightly off the map
            torch.testing.assert_close(head.lm_head.weight[j], scaled[t] @ fit, atol=1e-4,
                                       rtol=1e-4)
    # Drafting maps the draft ids back to the new tokens.
    ids, _ = head.draft_top(torch.randn(3, H, dtype=torch.float64, generator=g), 5)
    assert set(ids.flatten().tolist()) <= set(new_ids.tolist())


def test_training_goes_on_with_a_new_vocabulary_from_the_data(tmp_path):
    target_dir = tmp_path / "target"
    make_target(target_dir)
    write_data(tmp_path / "data.jsonl", n=16)
    write_data(tmp_path / "other.jsonl", n=16, seed=5)
    common = ["--target", str(target_dir), "--minutes", "1", "--batch", "2", "--no-cache",
              "--eval-fraction", "0.25", "--max-steps", "2"]
    first = tmp_path / "first"
    eagle3.train(eagle3.build_parser().parse_args(
        [*common, "--data", str(tmp_path / "data.jsonl"), "--out", str(first),
         "--draft-vocab", "16", "--intermediate-size", "32"]))
    second = tmp_path / "second"
    result = eagle3.train(eagle3.build_parser().parse_args(
        [*common, "--data", str(tmp_path / "other.jsonl"), "--out", str(second),
         "--init", str(first), "--new-vocab"]))
    loaded = load_head("eagle3", second, target_dir, dtype="float32")
    examples = eagle3.load_examples(tmp_path / "other.jsonl", max_len=640)
    random.Random(0).shuffle(examples)
    want = eagle3.draft_vocabulary(examples[result["held_out"]:], 16, VOCAB)
    assert torch.equal(loaded.d2t + torch.arange(16), want)
    old = load_head("eagle3", first, target_dir, dtype="float32")
    assert not torch.equal(old.d2t + torch.arange(16), want)
    assert "a new draft vocabulary" in (second / "TRAINING.md").read_text()
