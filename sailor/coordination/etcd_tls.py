"""An aetcd client that speaks TLS (aetcd 1.0.0 only opens insecure channels).

aetcd's ``Client.connect`` hard-codes ``grpc.aio.insecure_channel``; this subclass opens a
``secure_channel`` with the CA, and our client certificate when we have one (etcd's
``--client-cert-auth`` then takes the user name from its common name: no password, no token).
Everything else — stubs, watcher, error conversion — is aetcd's. Must never import NATS.
"""

from __future__ import annotations

from typing import Any

import aetcd
import grpc
from aetcd import rpc, watcher

__all__ = ["TlsClient"]


class TlsClient(aetcd.Client):  # type: ignore[misc]  # aetcd ships no type hints
    """``aetcd.Client`` over TLS; same constructor plus the PEM bytes."""

    def __init__(
        self, *, ca_pem: bytes, key_pem: bytes | None, cert_pem: bytes | None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._credentials = grpc.ssl_channel_credentials(
            root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem
        )

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]  # set by aetcd
            await super().connect()  # waits for the connecting task
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = rpc.secure_channel(
                target, self._credentials, options=list(self._options.items())
            )
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self.auth_stub = rpc.AuthStub(self.channel)
            self._watcher = watcher.Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False
