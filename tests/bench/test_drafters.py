"""bench/drafters.py: groups, categories and targets of the summary, from hand-made runs."""

from bench import drafters
from bench.prompts import by_name


def _run(prompt, method, k, decode_s, drafts=0, accepted=0):
    run = drafters.Run(prompt=prompt, method=method, k=k, tokens=[1] * 65, ttft_s=0.1,
                       decode_s=decode_s, decode_tokens=64, decode_steps=64 - accepted,
                       num_drafts=drafts, num_draft_tokens=drafts * k, num_accepted=accepted)
    return {**run.record(), "identical": True}


def test_summary_reports_categories_and_the_chat_target_on_chat_prompts_alone():
    prompts = by_name(["chat_learn_guitar", "summarise_bees", "code_edit_rename"])
    records = []
    for p in prompts:
        records.append(_run(p.name, "plain", 0, decode_s=4.0))
    # eagle3 at K=4: chat AL 1 + 40/40 = 2.0, summarise 1 + 20/40 = 1.5, code edit 3.0;
    # twice as fast as plain on chat, slower on the summary.
    records.append(_run("chat_learn_guitar", "eagle3", 4, decode_s=2.0, drafts=40, accepted=40))
    records.append(_run("summarise_bees", "eagle3", 4, decode_s=5.0, drafts=40, accepted=20))
    records.append(_run("code_edit_rename", "eagle3", 4, decode_s=1.0, drafts=40, accepted=80))
    summary = drafters.summarise(records, prompts, [("eagle3", 4)])
    row = next(r for r in summary if r["method"] == "eagle3")
    assert row["categories"]["chat"]["acceptance_length"] == 2.0
    assert row["categories"]["summarise"]["acceptance_length"] == 1.5
    assert row["groups"]["chat"]["acceptance_length"] == 2.0
    assert row["groups"]["other"]["acceptance_length"] == 1 + 60 / 80
    assert row["groups"]["all"]["acceptance_length"] == 1 + 140 / 120

    targets = {t["target"]: t for t in drafters.targets(summary)}
    chat_al = targets["eagle3 acceptance length >= 1.8 at K=4 (chat prompts)"]
    assert chat_al["value"] == 2.0 and chat_al["met"]
    other_al = targets["eagle3 acceptance length >= 1.8 at K=4 (other prompts)"]
    assert other_al["value"] == 1.75 and not other_al["met"]
    chat_speed = targets["eagle3 at its best K faster than plain on chat prompts"]
    assert chat_speed["value"] == 2.0 and chat_speed["met"]

    text = drafters.render({
        "model": "m", "device_name": "cpu", "cpus": 2, "torch": "t", "summary": summary,
        "targets": drafters.targets(summary), "notes": [], "load_average_1min": [0, 0],
        "config": {"verifier_threads": 1, "drafter_threads": 1, "max_tokens": 64,
                   "draft_deadline_ms": 100, "num_prompts": 3, "num_copy_heavy": 1}})
    assert "| eagle3 | 4 | 3.00 | 1.50 | 2.00 |" in text  # in the set's order
