"""fedseq-client: the device daemon (MQTT deployment; not implemented yet)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedseq-client", description="fedseq device daemon")
    parser.add_argument("--device", required=True, help="device name, e.g. jetson01")
    parser.parse_args(argv)
    print("error: fedseq-client (MQTT deployment) is not implemented yet; "
          "use fedseq-sim to run experiments in one process", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
