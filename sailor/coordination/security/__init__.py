"""Security of a deployment: certificates, NATS users and permissions, etcd RBAC, settings.

Pure builders (``certs``, ``nats_auth``, ``etcd_rbac``) and the daemons' opt-in settings
(``settings``). Lives inside ``coordination`` so that both the coordination backends (which
open TLS connections) and the CLI (``sailor certs``) may import it under the layer contract.
Applying RBAC to a live etcd is ``sailor.coordination.etcd_auth``.
"""

from sailor.coordination.security.settings import (
    NatsLogin,
    SecurityConfig,
    read_nats_login,
    warn_if_unauthenticated,
)

__all__ = ["NatsLogin", "SecurityConfig", "read_nats_login", "warn_if_unauthenticated"]
