"""`specdec-gateway` / `python -m gateway`."""

import sys


def main(argv: list[str] | None = None) -> int:
    # The entry point is part of the package layout from the start; the
    # service itself is built in issue 5.
    print("specdec-gateway: the gateway service is not built yet (issue 5); "
          "use `specdec chat` for a greedy reply from the target model", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
