"""Print the files of every fedseq module a device imports (fedseq-client, its doctor, the
data store), one per line: the closure that must stay Python 3.8 code."""

import sys

import fedseq.client.cli
import fedseq.client.daemon
import fedseq.client.doctor
import fedseq.common.data.store
import fedseq.common.dpsgd  # noqa: F401  (imported where a plan asks for DP-SGD)
import fedseq.server.cli.launch  # noqa: F401  (the commands' guard: a device runs it to be told no)

print("\n".join(sorted(m.__file__ for name, m in sys.modules.items()
                       if name.startswith("fedseq") and getattr(m, "__file__", None))))
