"""Transports behind one interface: REST (httpx) and gRPC (shared.pb stubs)."""

from __future__ import annotations

from .base import ROUTE_HEADER, GenerateResult, ModelInfo, Traffic, Transport, check_route_key, new_route_key
from .errors import CloudTimeout, CloudUnavailable, error_from_grpc, error_from_http, is_retryable
from .grpc_transport import GrpcTransport
from .rest import RestTransport

__all__ = ["ROUTE_HEADER", "CloudTimeout", "CloudUnavailable", "GenerateResult", "GrpcTransport", "ModelInfo",
           "RestTransport", "Traffic", "Transport", "check_route_key", "error_from_grpc", "error_from_http",
           "is_retryable", "make_transport", "new_route_key"]


def make_transport(cloud_url: str | None, grpc_target: str | None, api_key: str | None) -> Transport:
    """gRPC when a target is given, else REST."""
    if grpc_target:
        return GrpcTransport(grpc_target, api_key)
    if not cloud_url:
        raise ValueError("need a cloud URL or a gRPC target")
    return RestTransport(cloud_url, api_key)
