"""fedseq-client: the device daemon. Kept lean: argparse, no server-only imports."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fedseq-client", description="fedseq device daemon")
    p.add_argument("--device", required=True, help="this device's name, e.g. jetson01")
    p.add_argument("--broker", default="mqtt://127.0.0.1:1883", help="mqtt://HOST:PORT")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="folder holding MNIST/raw, FashionMNIST/raw, ... (default: the run's data.root)")
    p.add_argument("--state-dir", type=Path, default=Path("fedseq-state"),
                   help="where personal blocks are kept across restarts")
    p.add_argument("--torch-device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--topic-root", default="fedseq")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--username", default=None)
    p.add_argument("--password-file", type=Path, default=None)
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {args.device} %(levelname)s %(name)s: %(message)s")
    import torch

    from fedseq.client.daemon import DeviceDaemon
    from fedseq.common.errors import FedseqError

    if args.threads:
        torch.set_num_threads(args.threads)
    password = args.password_file.read_text().strip() if args.password_file else None
    try:
        daemon = DeviceDaemon(args.device, args.broker, args.data_dir, args.state_dir,
                              args.torch_device, args.topic_root, args.username, password)
    except FedseqError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    daemon.start(connect_timeout=None)  # keeps retrying in the background until the broker is up
    done.wait()
    daemon.stop()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
