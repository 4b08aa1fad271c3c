"""The companion's version, which the amprobe CLI that carries it reads (one version for both)."""

TOOL_VERSION = "0.1.0"
