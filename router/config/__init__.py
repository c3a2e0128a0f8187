"""One typed configuration, from defaults < a YAML file < environment < flags.

Every field is a flag (``--block-size``), a config key (``block_size``, at top level or in its
section: ``routing: {block_size: 32}``) and an environment variable
(``PREFIX_ROUTER_BLOCK_SIZE``; lists comma-separated). In code a field is read from its section
(``config.routing.block_size``). ``prefix-router serve --print-config`` prints the effective
result. sections.py: the fields; composed.py: ``Config`` and the flat names; load.py: reading them;
checks.py: their checks.
"""

from router.config.composed import FIELDS, Config, FieldRef
from router.config.disaggregation import Disaggregation
from router.config.errors import ConfigError, did_you_mean, mask_url_credentials
from router.config.load import (
    ENV_PREFIX,
    SECTIONS,
    Section,
    add_arguments,
    dump_yaml,
    load_config,
)
from router.config.sections import (
    Auth,
    Discovery,
    Fleet,
    Flow,
    Forwarding,
    Health,
    KvEvents,
    Limits,
    Registry,
    Routing,
    Server,
)

__all__ = [
    "ENV_PREFIX",
    "FIELDS",
    "SECTIONS",
    "Auth",
    "Config",
    "ConfigError",
    "Disaggregation",
    "Discovery",
    "FieldRef",
    "Fleet",
    "Flow",
    "Forwarding",
    "Health",
    "KvEvents",
    "Limits",
    "Registry",
    "Routing",
    "Section",
    "Server",
    "add_arguments",
    "did_you_mean",
    "dump_yaml",
    "load_config",
    "mask_url_credentials",
]
