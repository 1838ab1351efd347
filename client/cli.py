"""fedseq-client: the device daemon. Kept lean: argparse, no server-only imports."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedseq.client.settings import ClientSettings


def parser() -> argparse.ArgumentParser:
    """fedseq-client's command line (also the CLI reference's source, docs/reference)."""
    p = argparse.ArgumentParser(
        prog="fedseq-client",
        description="fedseq device daemon; `fedseq-client doctor [...]` checks this device instead. "
                    "Settings: --config FILE < FEDSEQ_<NAME> environment variables < flags.")
    from fedseq.common import __version__

    p.add_argument("--version", action="version", version=__version__)
    p.add_argument("command", nargs="?", choices=["run", "doctor"], default="run",
                   help="run the daemon (default) or check this device")
    p.add_argument("--config", type=Path, default=None, help="TOML settings, e.g. /etc/fedseq/client.toml")
    p.add_argument("--device", help="this device's name, e.g. jetson01")
    p.add_argument("--broker", help="mqtt://HOST:PORT (default mqtt://127.0.0.1:1883)")
    p.add_argument("--data-dir", type=Path,
                   help="this device's data: the data root of a shared dataset (MNIST/raw, "
                        "FashionMNIST/raw, ...), or with data.placement = \"device\" its own "
                        "clients' folder (train.npz/test.npz, train.csv/test.csv or train/ and "
                        "test/, or one <client>/ folder of them each) (default: $FEDSEQ_DATA, "
                        "else ~/.local/share/fedseq/data)")
    p.add_argument("--state-dir", type=Path,
                   help="where personal state (personal blocks, residuals) is kept across restarts")
    p.add_argument("--torch-device", choices=["auto", "cpu", "cuda"],
                   help="where to train (default auto: CUDA when available)")
    p.add_argument("--topic-root", help="MQTT topic root (default fedseq)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--username", help="broker login (default: none; usually the device name)")
    p.add_argument("--password-file", type=Path, help="file holding the broker password")
    p.add_argument("--ca-file", type=Path, help="mqtts://: PEM file of the CA that signed the broker")
    p.add_argument("--cert-file", type=Path, help="mutual TLS: this device's PEM certificate")
    p.add_argument("--key-file", type=Path, help="mutual TLS: the certificate's PEM key")
    p.add_argument("--no-verify-hostname", dest="verify_hostname", action="store_false",
                   default=None, help="accept a broker certificate that does not name its host")
    p.add_argument("--log-level", help="DEBUG, INFO (default), WARNING or ERROR")
    p.add_argument("--allow-plugin", action="append", metavar="NAME",
                   help="let runs use this installed plugin (a registered model, dataset, algorithm "
                        "or aggregation rule; repeatable); fedseq's built-ins are always allowed")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """fedseq-client's options (`argv`, else the command line's)."""
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """fedseq-client: the daemon, or its `doctor`; the exit status (2: a one-line error)."""
    args = parse_args(argv)
    from fedseq.client.settings import load_settings
    from fedseq.common.errors import FedseqError

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        s = load_settings(args.config, flags)
    except FedseqError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from fedseq.common.registry import REGISTRY

    REGISTRY.restrict(s.plugins.allow)  # a device imports only what its operator allowed
    if args.command == "doctor":
        from fedseq.client.doctor import run_doctor

        return run_doctor(s)
    return _serve(s)


def _serve(s: ClientSettings) -> int:
    """The daemon of settings `s` until SIGTERM or SIGINT (0), or a fatal error (2, one line)."""
    from fedseq.common.errors import FedseqError

    logging.basicConfig(level=s.log_level.upper(),
                        format=f"%(asctime)s {s.device} %(levelname)s %(name)s: %(message)s")
    import torch

    from fedseq.client.daemon import DeviceDaemon
    from fedseq.client.stack import numpy_facts

    problem = numpy_facts()[1]
    if problem:  # every round would fail on it: refuse before connecting
        print(f"error: {problem}", file=sys.stderr)
        return 2

    if s.threads:
        torch.set_num_threads(s.threads)
    from fedseq.common.files import read_secret
    from fedseq.common.protocol.link import TlsOptions

    try:
        password = read_secret(s.password_file)
    except FedseqError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from fedseq.common.stopping import SignalStop

    stopping = SignalStop()  # its handler is re-entrant (a second signal, common/stopping.py)
    done = stopping.event
    # decoded image folders (data.placement = "device") are cached beside the clients' state
    os.environ.setdefault("FEDSEQ_CACHE", str(Path(s.state_dir) / "cache"))
    try:
        tls = TlsOptions(s.ca_file, s.cert_file, s.key_file, s.verify_hostname)
        daemon = DeviceDaemon(s.device, s.broker, s.data_dir, s.state_dir, s.torch_device,
                              s.topic_root, s.username, password, tls)
        stopping.then = daemon.link.cancel
        signal.signal(signal.SIGTERM, stopping.handler)
        signal.signal(signal.SIGINT, stopping.handler)
        fatal: list[str] = []

        def on_fatal(msg: str) -> None:
            fatal.append(msg)
            done.set()

        daemon.link.on_fatal(on_fatal)
        daemon.start()  # an unreachable broker is retried until it is up; a refused login is not
    except FedseqError as exc:
        if done.is_set():
            return 0
        print(f"error: {exc}", file=sys.stderr)
        return 2
    done.wait()
    daemon.stop()
    if fatal:  # the broker stopped accepting this device: fail, so systemd shows it
        print(f"error: {fatal[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
