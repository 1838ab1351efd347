"""The one registry of named things: models, datasets, algorithms and aggregation rules.

Every name a config, the wire or a CLI uses is an entry point of an installed distribution, in
one of four groups (`GROUPS`): `fedseq.models`, `fedseq.datasets`, `fedseq.algorithms`,
`fedseq.aggregators`, each `name = "module:attr"`. fedseq's own built-ins are declared in its
pyproject.toml exactly as a lab's package declares its plugins, and are found the same way: from
the installed metadata (`importlib.metadata`), so every process of a run (a `--workers` rank, a
device daemon) finds what its own environment has installed, without a sitecustomize or an edit.

- Names are looked up without importing anything; an entry's code is imported only when the name
  is used (`load`), once per process.
- One name in one group from two distributions is an error naming both (`RegistryError`).
- A name is a registered name, never a module path: `model.name = "pkg.mod:make"` is refused in
  one line and imports nothing.
- A device (fedseq-client) restricts what it will import to fedseq's built-ins and the plugin
  names its operator allowed (`restrict`, from `--allow-plugin` / `plugins.allow`); the
  coordinator and the simulation use whatever their environment has installed.

Standard library only, so a device (Python >= 3.8) uses it as the coordinator does.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import re
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

from fedseq.common.errors import ConfigError
from fedseq.common.text import printable

#: the groups, by the short name the code and `fedseq plugins` use
GROUPS = {"models": "fedseq.models", "datasets": "fedseq.datasets",
          "algorithms": "fedseq.algorithms", "aggregators": "fedseq.aggregators"}
#: what one entry of each group is called in a message ("unknown model 'x'")
KINDS = {"models": "model", "datasets": "dataset", "algorithms": "algorithm",
         "aggregators": "aggregation rule"}
#: the distribution that provides the built-ins (always allowed on a device)
BUILTIN = "fedseq"
#: the groups a device resolves when it follows a run (an aggregation rule runs on the
#: coordinator and the sites' edges alone: a device neither loads nor needs one)
DEVICE_GROUPS = ("models", "datasets", "algorithms")
#: a registered name: what an entry point name may be (no module path, no spaces)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,63}$")


class RegistryError(ConfigError):
    """A name is unknown, not allowed here, a module path, or claimed by two distributions."""


@dataclass(frozen=True)
class Entry:
    """One registered name: where its code is (`value`, "module:attr") and which installed
    distribution (and version) declared it."""

    group: str
    name: str
    value: str
    distribution: str
    version: str

    @property
    def builtin(self) -> bool:
        """Whether fedseq itself provides it (always allowed)."""
        return self.distribution == BUILTIN


def _canonical(dist_name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", dist_name).lower()


class Registry:
    """The entries of every installed distribution, scanned once (`refresh` scans again), and the
    objects loaded from them, each once."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._entries: Optional[Dict[str, Dict[str, Entry]]] = None
        self._loaded: Dict[tuple, Any] = {}
        self._allowed: Optional[frozenset] = None  # None: everything installed

    # -- what is installed -------------------------------------------------------------------
    def refresh(self) -> None:
        """Forget the scan and the loaded objects (after installing a package in this process)."""
        with self._lock:
            self._entries = None
            self._loaded.clear()

    def _scan(self) -> Dict[str, Dict[str, Entry]]:
        with self._lock:
            if self._entries is None:
                self._entries = _scan_installed()
            return self._entries

    def entries(self, group: str) -> List[Entry]:
        """The group's entries, by name."""
        return [e for _, e in sorted(self._scan()[_group(group)].items())]

    def names(self, group: str) -> List[str]:
        """The group's registered names, sorted."""
        return sorted(self._scan()[_group(group)])

    def has(self, group: str, name: str) -> bool:
        """Whether `name` is registered in `group` (imports nothing)."""
        return isinstance(name, str) and name in self._scan()[_group(group)]

    def entry(self, group: str, name: str) -> Entry:
        """The entry of `name`, or a one-line RegistryError: a module path, an unknown name (with
        the group's names), or a plugin this process is not allowed to use."""
        kind = KINDS[_group(group)]
        if not isinstance(name, str) or not NAME.match(name):
            shown = printable(str(name), 60)
            if isinstance(name, str) and (":" in name or "/" in name or "." in name):
                raise RegistryError(
                    f"{kind} {shown!r} looks like a module path; fedseq uses registered names only "
                    f"(an entry point in the group {GROUPS[group]} of an installed package: "
                    "`fedseq plugins` lists them) and imports no path from a config or the wire")
            raise RegistryError(f"{kind} name {shown!r} is not a registered name; use one of "
                                f"{', '.join(self.names(group))}")
        found = self._scan()[group].get(name)
        if found is None:
            raise RegistryError(f"unknown {kind} {name!r}; use one of {', '.join(self.names(group))}"
                                " (a plugin's name needs its package installed here: `fedseq "
                                "plugins` lists what is)")
        if not found.builtin and self._allowed is not None and name not in self._allowed:
            raise RegistryError(
                f"{kind} {name!r} (from {found.distribution} {found.version}) is installed but not "
                f"allowed on this device: start fedseq-client with --allow-plugin {name} (or add it "
                "to plugins.allow in its settings)")
        return found

    def load(self, group: str, name: str) -> Any:
        """The object `name` registers (imported on first use, then kept)."""
        found = self.entry(group, name)
        key = (found.group, found.name)
        with self._lock:
            if key not in self._loaded:
                self._loaded[key] = _import(found)
            return self._loaded[key]

    # -- what this process may import ---------------------------------------------------------
    def restrict(self, allowed: Optional[Iterable[str]]) -> None:
        """Allow only fedseq's built-ins and these plugin names (a device's settings); None:
        everything installed (the coordinator, the simulation)."""
        with self._lock:
            self._allowed = None if allowed is None else frozenset(allowed)

    @property
    def allowed(self) -> Optional[frozenset]:
        """The plugin names this process may use beside the built-ins; None: all installed."""
        return self._allowed

    def pins(self, names: Dict[str, str], code: bool = True) -> Dict[str, str]:
        """"group/name" -> "distribution==version" of each plugin among a run's names ({group:
        name}; fedseq's built-ins left out: a device's fedseq version is checked apart), with
        " code <digest>" of its installed source (`code_digest`) unless `code` is False
        (deploy.pin_plugin_code): what a device must have installed to follow the run bitwise
        (RunConfig.plugins)."""
        out = {}
        for group, name in names.items():
            e = self.entry(group, name)
            if not e.builtin:
                digest = code_digest(e) if code else None
                out[f"{group}/{name}"] = (f"{e.distribution}=={e.version}"
                                          + (f" code {digest}" if digest else ""))
        return out

    def pin_problem(self, pins: Dict[str, str], groups: Iterable[str] = tuple(GROUPS)
                    ) -> Optional[str]:
        """Why this process cannot follow a run whose plugins are `pins` (`pins`), or None: a
        name of `groups` (what this process runs: DEVICE_GROUPS on a device) installed here
        from another distribution or version, or (where the pin has a digest) whose installed
        code differs from the coordinator's. A name not installed or not allowed here is the
        config's validation to say."""
        for key, pin in sorted(pins.items()):
            group, _, name = key.partition("/")
            if group not in groups or not self.has(group, name):
                continue
            e = self._scan()[group][name]
            want, _, digest = pin.partition(" code ")
            if f"{e.distribution}=={e.version}" != want:
                return (f"{KINDS[group]} {name!r} is {printable(want, 100)} on the coordinator "
                        f"but {e.distribution} {e.version} here (pip install "
                        f"'{printable(want, 100)}' on this device)")
            here = code_digest(e) if digest else None
            if here is not None and here != digest:
                return (f"{KINDS[group]} {name!r} ({e.distribution} {e.version}) runs other code "
                        f"here than on the coordinator (its source's digest {here}, the "
                        f"coordinator's {printable(digest, 20)}): install the same code on both "
                        "(an edited `pip install -e` checkout counts), or run with "
                        "deploy.pin_plugin_code = false")
        return None

    def device_refusal(self, group: str, name: str) -> Optional[str]:
        """Why a device following a run that names `name` in `group` would refuse it (not
        installed, not allowed here), or None: the lookup its config validation makes, and
        nothing for a group a device never resolves (`DEVICE_GROUPS`). fedseq-client doctor
        asks this, so it says what the daemon does."""
        if group not in DEVICE_GROUPS:
            return None
        try:
            self.entry(group, name)
        except RegistryError as exc:
            return str(exc)
        return None

    def used(self, names: Dict[str, str]) -> List[Dict[str, str]]:
        """The distributions behind a run's names ({group: name}), for its run directory."""
        out = []
        for group, name in names.items():
            e = self.entry(group, name)
            out.append({"group": group, "name": name, "value": e.value,
                        "distribution": e.distribution, "version": e.version})
        return out


def _group(group: str) -> str:
    if group not in GROUPS:
        raise KeyError(f"no registry group {group!r}; the groups are {', '.join(GROUPS)}")
    return group


def _scan_installed() -> Dict[str, Dict[str, Entry]]:
    """Every entry point of the four groups, from each installed distribution once (the first on
    sys.path wins, as importlib's own lookup does); a name two distributions declare is an error."""
    by_group = {g: {} for g in GROUPS}  # type: Dict[str, Dict[str, Entry]]
    group_of = {v: k for k, v in GROUPS.items()}
    for dist_name, dist in _installed().items():
        for ep in dist.entry_points:
            group = group_of.get(ep.group)
            if group is None:
                continue
            other = by_group[group].get(ep.name)
            if other is not None:
                raise RegistryError(
                    f"{KINDS[group]} {ep.name!r} is registered by two installed packages, "
                    f"{other.distribution} {other.version} ({other.value}) and {dist_name} "
                    f"{dist.version} ({ep.value}); uninstall one of them")
            if not NAME.match(ep.name):
                continue  # not a name a config can hold (`fedseq plugins` would show nothing)
            by_group[group][ep.name] = Entry(group, ep.name, ep.value, dist_name, dist.version)
    if not any(e.builtin for g in by_group.values() for e in g.values()):
        raise RegistryError("fedseq's installed metadata declares none of its built-in models, "
                            "datasets and algorithms: reinstall it (pip install -e . in a checkout, "
                            "or pip install fedseq)")
    return by_group


def _installed() -> Dict[str, Any]:
    """Each installed distribution once, by canonical name: the first on sys.path, except that an
    installed `.dist-info` wins over a `.egg-info` (what a build leaves in a source checkout,
    stale after pyproject.toml changes, and found first when Python runs from that checkout)."""
    found = {}  # type: Dict[str, Any]
    for dist in metadata.distributions():
        name = _canonical(dist.metadata["Name"] or "")
        if not name:
            continue
        if name not in found or (_is_egg_info(found[name]) and not _is_egg_info(dist)):
            found[name] = dist
    return found


def _is_egg_info(dist: Any) -> bool:
    return str(getattr(dist, "_path", "")).rstrip("/\\").endswith(".egg-info")


def code_digest(entry: Entry) -> Optional[str]:
    """The first 16 hex digits of the SHA-256 of the source an entry's code comes from: every
    .py file of its top-level package (or its one module), by relative path, as installed here;
    an editable install's checkout is what counts. Found without importing it; None where its
    source cannot be found (a compiled module, a zip)."""
    import hashlib
    import importlib.util
    from pathlib import Path

    top = entry.value.partition(":")[0].strip().split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    roots = [Path(p) for p in (spec.submodule_search_locations or [])]
    files = sorted((str(f.relative_to(r)), f) for r in roots if r.is_dir()
                   for f in r.rglob("*.py"))
    if not roots and spec.origin and spec.origin.endswith(".py"):
        files = [(Path(spec.origin).name, Path(spec.origin))]
    if not files:
        return None
    h = hashlib.sha256()
    for rel, path in files:
        h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _import(entry: Entry) -> Any:
    module, _, attr = entry.value.partition(":")
    try:
        obj: Any = importlib.import_module(module.strip())
        for part in attr.strip().split(".") if attr.strip() else []:
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise RegistryError(
            f"{KINDS[entry.group]} {entry.name!r} of {entry.distribution} {entry.version} cannot "
            f"be loaded from {entry.value} ({type(exc).__name__}: {exc}); reinstall "
            f"{entry.distribution}") from exc
    return obj


#: the registry of this process
REGISTRY = Registry()


def plugin_table() -> List[Dict[str, Any]]:
    """Every registered name by group, with its distribution and version (`fedseq plugins`)."""
    return [{"group": g, "name": e.name, "value": e.value, "distribution": e.distribution,
             "version": e.version, "builtin": e.builtin}
            for g in GROUPS for e in REGISTRY.entries(g)]


__all__ = ["BUILTIN", "DEVICE_GROUPS", "Entry", "GROUPS", "KINDS", "REGISTRY", "Registry", "RegistryError",
           "plugin_table"]
