"""`fogctl`: inspect and steer the fleet over MQTT (commands arrive with the fogctl issue)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fogctl", description="Inspect and steer a fog-agent fleet over MQTT.")
    parser.add_argument("--broker", default="127.0.0.1:1883", help="host:port of the MQTT broker")
    parser.add_argument("--cluster", default="default", help="cluster name (topic prefix fog/<cluster>)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    build_parser().parse_args(argv)
    print("fogctl: no command given (see --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
