"""The daemon's settings: a TOML file (/etc/fedseq/client.toml), FEDSEQ_* environment variables
and command-line flags, in rising precedence."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedseq.common.data.store import default_data_root
from fedseq.common.errors import ConfigError, validation_problem
from fedseq.common.protocol.topics import DEVICE_NAME

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ClientSettings(BaseModel):
    """The daemon's settings (file < FEDSEQ_* environment < flags), validated."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field(pattern=rf"^{DEVICE_NAME.pattern}$")
    broker: str = "mqtt://127.0.0.1:1883"
    username: Optional[str] = None
    password_file: Optional[Path] = None
    ca_file: Optional[Path] = None  # mqtts://: the CA that signed the broker's certificate
    cert_file: Optional[Path] = None  # mutual TLS: this device's certificate and key
    key_file: Optional[Path] = None
    verify_hostname: bool = True
    # this device's data root, whatever the coordinator's is ($FEDSEQ_DATA or the default)
    data_dir: Path = Field(default_factory=default_data_root)
    state_dir: Path = Path("fedseq-state")
    torch_device: Literal["auto", "cpu", "cuda"] = "auto"
    topic_root: str = "fedseq"
    threads: Optional[int] = Field(None, ge=1)
    log_level: str = "INFO"


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
        key = f"FEDSEQ_{name.upper()}"
        if env.get(key):
            values[name] = env[key]
    if "verify_hostname" in values and isinstance(values["verify_hostname"], str):
        values["verify_hostname"] = values["verify_hostname"].lower() not in ("0", "false", "no")
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        return ClientSettings.model_validate(values)
    except ValidationError as exc:
        p = validation_problem(exc)
        hint = "set it with --device NAME, FEDSEQ_DEVICE or device = ... in the config file"
        msg = hint if p.kind == "missing" else p.msg
        raise ConfigError(f"client setting {p.where or 'settings'}: {msg}") from exc
