"""Plain greedy decode speed: our model core against transformers, same
process, same prompts, same thread count, float32 and bfloat16.

Decode rate is (N - 1) / (time(N tokens) - time(1 token)), which takes the
prefill out of both. Runs alternate between the two implementations so that
noise on a shared machine hits both alike.

    .venv/bin/python bench/decode.py [--tokens 128] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

from specdec.generate import greedy_generate
from specdec.models import load_model
from specdec.models.prepare import prepare_default_model
from specdec.tokenizer import Tokenizer

PROMPTS = [
    "Write a Python function that reverses the words of a sentence.",
    "Explain what a hash table is to a new programmer.",
    "Give three tips for writing clear commit messages.",
]
# Bytes of weights read per decoded token, over this machine's measured
# memory bandwidth, bounds the rate (see the closing note of issue 2).
BANDWIDTH_GBPS = 19.5


def time_ours(model, prompt: list[int], n: int) -> float:
    t0 = time.perf_counter()
    out = greedy_generate(model, [prompt], n)
    assert len(out[0]) == n
    return time.perf_counter() - t0


def time_hf(hf, prompt: list[int], n: int) -> float:
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + n
    return time.perf_counter() - t0


def decode_rate(timer, model, prompts, n: int) -> float:
    """Tokens/s of decoding alone, averaged over prompts."""
    rates = []
    for p in prompts:
        one = timer(model, p, 1)
        full = timer(model, p, n)
        rates.append((n - 1) / max(full - one, 1e-9))
    return statistics.mean(rates)


def render_table(result: dict) -> str:
    lines = [
        f"Decode, batch 1, greedy, {result['tokens']} tokens, {result['threads']} threads, "
        f"{result['device']} (torch {result['torch']}, transformers {result['transformers']})",
        "",
        "| dtype | ours tok/s | transformers tok/s | ours / transformers | bandwidth floor tok/s |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['dtype']} | {r['ours_tok_s']:.1f} | {r['transformers_tok_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['bandwidth_floor_tok_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="Hugging Face directory (default: the prepared default model)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode.json"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else prepare_default_model()
    tok = Tokenizer.from_dir(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        ours = load_model(model_dir, dtype=dtype_name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        hf.generation_config.eos_token_id = None
        weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
        time_ours(ours, prompts[0], 4)  # warm-up both
        time_hf(hf, prompts[0], 4)
        ours_r, hf_r = [], []
        for _ in range(args.repeats):
            ours_r.append(decode_rate(time_ours, ours, prompts, args.tokens))
            hf_r.append(decode_rate(time_hf, hf, prompts, args.tokens))
        row = {
            "dtype": dtype_name,
            "ours_tok_s": statistics.median(ours_r),
            "transformers_tok_s": statistics.median(hf_r),
            "ours_runs": ours_r,
            "transformers_runs": hf_r,
            "weight_bytes": weight_bytes,
            "bandwidth_floor_tok_s": BANDWIDTH_GBPS * 1e9 / weight_bytes,
        }
        row["speedup"] = row["ours_tok_s"] / row["transformers_tok_s"]
        rows.append(row)
        del ours, hf

    result = {
        "bench": "decode",
        "model": model_dir.name,
        "tokens": args.tokens,
        "threads": args.threads,
        "prompts": len(prompts),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "device": "cpu",
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    table = render_table(result)
    out.with_suffix(".md").write_text(table)
    print(table, end="")
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
