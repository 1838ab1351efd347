"""One error hierarchy per boundary. Each message is one line saying what is wrong and how to fix it."""


class FedseqError(Exception):
    """Base of every error fedseq raises on purpose."""


class ConfigError(FedseqError):
    """A config file, key or value is unusable."""


class DatasetError(FedseqError):
    """A dataset file is missing or malformed."""


class ProtocolError(FedseqError):
    """A message or tensor frame failed validation."""


class TransportError(FedseqError):
    """The broker or a peer could not be reached or misbehaved."""
