"""The device client must not pull in server-only packages (Jetsons install only what it needs)."""

import subprocess
import sys


def test_client_imports_no_server_only_modules():
    code = ("import sys, fedseq.client.cli, fedseq.client.daemon, fedseq.client.doctor, "
            "fedseq.client.settings; print(sorted({m.split('.')[0] for m in sys.modules} | "
            "{m for m in sys.modules if m.startswith('fedseq.')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    for heavy in ("'amqtt'", "'typer'", "'rich'", "'fedseq.server"):
        assert heavy not in out, heavy
