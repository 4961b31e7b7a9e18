"""`specdec-drafter` / `python -m drafter`."""

import sys


def main(argv: list[str] | None = None) -> int:
    # The entry point is part of the package layout from the start; the
    # service itself is built in issue 4.
    print("specdec-drafter: the drafter service is not built yet (issue 4); "
          "use `specdec chat` for a greedy reply from the target model", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
