"""`specdec-verifier` / `python -m verifier`."""

import sys


def main(argv: list[str] | None = None) -> int:
    # The entry point is part of the package layout from the start; the
    # service itself is built in issue 3.
    print("specdec-verifier: the verifier service is not built yet (issue 3); "
          "use `specdec chat` for a greedy reply from the target model", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
