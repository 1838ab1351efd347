"""Code shared by the coordinator and the device client: config, data, models, algorithms, wire."""

__version__ = "0.1.0"
