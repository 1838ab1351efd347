"""The daemon's settings: a TOML file (/etc/fedseq/client.toml), FEDSEQ_* environment variables
and command-line flags, in rising precedence."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fedseq.common.data.store import default_data_root
from fedseq.common.errors import ConfigError, validation_problem
from fedseq.common.protocol.topics import DEVICE_NAME

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class PluginSettings(BaseModel):
    """[plugins]: which installed plugins this device may import (common/registry.py)."""

    model_config = ConfigDict(extra="forbid")

    allow: List[str] = Field(default_factory=list, description=(
        "Plugin names (entry points of packages installed in this device's environment) this "
        "device may resolve; fedseq's built-ins are always allowed. --allow-plugin NAME adds one."))

    @field_validator("allow")
    @classmethod
    def _names(cls, v: List[str]) -> List[str]:
        from fedseq.common.registry import NAME

        for name in v:
            if not NAME.match(name):
                raise ValueError(f"{name[:60]!r} is not a plugin name (an entry point's name: "
                                 "letters, digits, - and _), never a module path")
        return v


class ClientSettings(BaseModel):
    """The daemon's settings (file < FEDSEQ_* environment < flags), validated."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field(pattern=rf"^{DEVICE_NAME.pattern}$", description=(
        "This device's name, e.g. jetson01 (letters, digits, - and _); its broker login usually."))
    broker: str = Field("mqtt://127.0.0.1:1883", description="mqtt://HOST:PORT or mqtts://HOST:PORT.")
    username: Optional[str] = Field(None, description="The broker login (usually the device name).")
    password_file: Optional[Path] = Field(None, description="A file holding the broker password.")
    ca_file: Optional[Path] = Field(None, description=(
        "mqtts://: the PEM file of the CA that signed the broker's certificate."))
    cert_file: Optional[Path] = Field(None, description="Mutual TLS: this device's PEM certificate.")
    key_file: Optional[Path] = Field(None, description="Mutual TLS: the certificate's PEM key.")
    verify_hostname: bool = Field(True, description=(
        "Check that the broker's certificate names the host connected to."))
    data_dir: Path = Field(default_factory=default_data_root, description=(
        "This device's data root, whatever the coordinator's is (default: $FEDSEQ_DATA, else "
        "~/.local/share/fedseq/data)."))
    state_dir: Path = Field(Path("fedseq-state"), description=(
        "Where each logical client's personal state (personal blocks, error-feedback residuals) "
        "is kept across restarts."))
    torch_device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "Where to train: auto (CUDA when available), cpu or cuda."))
    topic_root: str = Field("fedseq", description="The MQTT topic root (deploy.topic_root).")
    threads: Optional[int] = Field(None, ge=1, description="torch CPU threads (default: torch's).")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR.")
    plugins: PluginSettings = Field(default_factory=PluginSettings, description=(
        "[plugins]: `allow`, the installed plugins this device may use."))


def load_settings(config: Path | None, flags: dict[str, Any],
                  environ: dict[str, str] | None = None) -> ClientSettings:
    """File < FEDSEQ_<FIELD> environment variables < flags (None flags are ignored)."""
    values: dict[str, Any] = {}
    if config is not None:
        try:
            values.update(tomllib.loads(Path(config).read_text()))
        except FileNotFoundError as exc:
            raise ConfigError(f"client config {config} not found; pass an existing --config") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{config}: invalid TOML ({exc}); fix the file") from exc
    env = os.environ if environ is None else environ
    for name in ClientSettings.model_fields:
        if name == "plugins":  # a table: the file and --allow-plugin set it
            continue
        key = f"FEDSEQ_{name.upper()}"
        if env.get(key):
            values[name] = env[key]
    if "verify_hostname" in values and isinstance(values["verify_hostname"], str):
        values["verify_hostname"] = values["verify_hostname"].lower() not in ("0", "false", "no")
    flags = dict(flags)
    allow = flags.pop("allow_plugin", None)
    values.update({k: v for k, v in flags.items() if v is not None})
    if allow:  # --allow-plugin adds to the file's [plugins] allow
        table = dict(values.get("plugins") or {}) if isinstance(values.get("plugins"), dict) else {}
        table["allow"] = list(table.get("allow") or []) + list(allow)
        values["plugins"] = table
    try:
        return ClientSettings.model_validate(values)
    except ValidationError as exc:
        p = validation_problem(exc)
        hint = "set it with --device NAME, FEDSEQ_DEVICE or device = ... in the config file"
        msg = hint if p.kind == "missing" else p.msg
        raise ConfigError(f"client setting {p.where or 'settings'}: {msg}") from exc
