"""Configuration (SPEC 9): load and validate a config file against an adapter registry
that the caller gives (this layer never imports the adapters). See `relay.config.load`."""

from .load import (
    COMMON_PROVIDER_KEYS,
    PACKAGED_DEFAULT,
    ClientConfig,
    Config,
    Registry,
    RouteConfig,
    ServerConfig,
    best_pattern,
    check_target,
    default_config_path,
    load_config,
    parse_config,
)

__all__ = ["COMMON_PROVIDER_KEYS", "PACKAGED_DEFAULT", "ClientConfig", "Config", "Registry",
           "RouteConfig", "ServerConfig", "best_pattern", "check_target", "default_config_path",
           "load_config", "parse_config"]
