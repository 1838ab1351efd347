"""Entry points of the coordinator-side commands (fedseq-sim, fedseq-server, fedseq).

A device installs fedseq without the server extra, on Python 3.8 or 3.9, where these commands
cannot run: this module (itself Python 3.8 code with no third-party import) turns that into one
line naming the fix instead of a traceback from deep inside an import."""

import importlib.util
import sys

SERVER_PACKAGES = ("typer", "rich", "amqtt", "tomli_w")


def _check(command: str) -> None:
    if sys.version_info < (3, 10):
        v = ".".join(map(str, sys.version_info[:3]))
        sys.exit(f"error: {command} needs Python >= 3.10 (this is {v}); a device needs only "
                 "fedseq-client: run the coordinator and the tools on a machine with Python >= 3.10")
    missing = [m for m in SERVER_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"error: {command} needs the server extra ({', '.join(missing)} missing): "
                 "pip install 'fedseq[server]' (a device needs only fedseq-client)")


def _one_config(command: str) -> None:
    """One experiment file: a second --config would silently replace the first."""
    given = [a for a in sys.argv[1:] if a in ("--config", "-c") or a.startswith("--config=")]
    if len(given) > 1:
        print(f"error: {command}: --config given {len(given)} times; give one experiment file, "
              "and change its keys with --set KEY=VALUE", file=sys.stderr)
        sys.exit(2)


def sim_main() -> None:
    """The fedseq-sim script: refuses in one line where the coordinator's stack is missing, else
    runs the command."""
    _check("fedseq-sim")
    _one_config("fedseq-sim")
    from fedseq.server.cli.commands import sim_main as main

    main()


def server_main() -> None:
    """The fedseq-server script: refuses in one line where the coordinator's stack is missing, else
    runs the command."""
    _check("fedseq-server")
    _one_config("fedseq-server")
    from fedseq.server.cli.commands import server_main as main

    main()


def tools_main() -> None:
    """The fedseq script: refuses in one line where the coordinator's stack is missing, else runs
    the command."""
    _check("fedseq")
    from fedseq.server.cli.tools import main

    main()
