"""The flood guard login's roles in Mosquitto's dynamic-security file touch the plugin's control
topic alone: `mosquitto_ctrl dynsec init` gives its admin '#' and $SYS/#, and the plugin's
default lets its logins receive whatever they subscribe to; the guard only lists, creates,
disables and deletes logins (docs/security.md).

    python3 limit_guard_role.py DYNSEC_FILE LOGIN

Prints "changed" when it rewrote the file. The rule of fedseq's server/ops/broker.py
`limit_guard_role`, for a broker host without fedseq: standard library only."""

import json
import os
import sys
import tempfile

CONTROL = "$CONTROL/dynamic-security/"


def limited(acls):
    kept = [dict(a, priority=1) for a in acls if str(a.get("topic", "")).startswith(CONTROL)]
    return kept + [{"acltype": kind, "topic": "#", "priority": 0, "allow": False}
                   for kind in ("publishClientSend", "publishClientReceive", "subscribePattern")]


def main(path, login):
    with open(path) as f:
        data = json.load(f)
    roles = {r.get("rolename") for c in data.get("clients", []) if c.get("username") == login
             for r in c.get("roles", [])}
    changed = False
    for role in data.get("roles", []):
        if role.get("rolename") in roles:
            new = limited(role.get("acls", []))
            changed = changed or new != role.get("acls", [])
            role["acls"] = new
    if changed:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".dynsec-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        print("changed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
