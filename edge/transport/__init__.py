"""Transports behind one interface: REST (httpx) and gRPC (shared.pb stubs)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .base import ROUTE_HEADER, GenerateResult, ModelInfo, Traffic, Transport, check_route_key, new_route_key
from .errors import CloudTimeout, CloudUnavailable, error_from_grpc, error_from_http, is_retryable
from .grpc_transport import GrpcTransport
from .rest import RestTransport

if TYPE_CHECKING:
    from ..settings import EdgeSettings

__all__ = ["ROUTE_HEADER", "CloudTimeout", "CloudUnavailable", "GenerateResult", "GrpcTransport", "ModelInfo",
           "RestTransport", "Traffic", "Transport", "check_route_key", "error_from_grpc", "error_from_http",
           "is_retryable", "make_transport", "new_route_key", "transport_for"]


def make_transport(cloud_url: str | None, grpc_target: str | None, api_key: str | None, *, grpc_tls: bool = False,
                   ca_cert: str | None = None) -> Transport:
    """gRPC when a target is given (TLS with `grpc_tls`), else REST (TLS for an https:// URL); `ca_cert`: the PEM
    file of a private CA that signed the cloud's certificate (default: the system's trust)."""
    if grpc_target:
        return GrpcTransport(grpc_target, api_key, tls=grpc_tls, ca_cert=ca_cert)
    if not cloud_url:
        raise ValueError("need a cloud URL or a gRPC target")
    return RestTransport(cloud_url, api_key, ca_cert=ca_cert)


def sends_key_privately(settings: EdgeSettings) -> bool:
    """TLS to the cloud, or a cloud on this machine (loopback)."""
    from urllib.parse import urlsplit

    from shared.hosts import is_loopback

    if settings.grpc_target:
        return settings.grpc_tls or is_loopback(settings.grpc_target.rsplit(":", 1)[0])
    url = urlsplit(settings.cloud_url)
    return url.scheme == "https" or is_loopback(url.hostname or "")


def transport_for(settings: EdgeSettings) -> Transport:
    """The transport `settings` name: their cloud URL or gRPC target, key, TLS and CA."""
    key = settings.api_key.get_secret_value() if settings.api_key else None
    if key and not sends_key_privately(settings):
        logging.getLogger(__name__).warning(
            "the cloud key goes in clear to %s: use an https:// --cloud URL (or --grpc-tls) behind TLS (README, "
            "\"TLS in front of the cloud\")", settings.grpc_target or settings.cloud_url)
    return make_transport(settings.cloud_url, settings.grpc_target, key, grpc_tls=settings.grpc_tls,
                          ca_cert=settings.ca_cert)
