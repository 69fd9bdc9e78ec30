"""Error statuses map back to the project's error types in one place, for REST and gRPC alike."""

from __future__ import annotations

import json

import grpc
import pytest

from edge.transport.errors import (
    CloudTimeout,
    CloudUnavailable,
    error_from_grpc,
    error_from_http,
    is_retryable,
)
from shared.errors import (
    ContextMismatch,
    Internal,
    InvalidArgument,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    ResourceExhausted,
    SpecSplitError,
    Unauthenticated,
    Unavailable,
)


@pytest.mark.parametrize("status, cls", [(422, InvalidArgument), (404, NotFound), (409, ContextMismatch),
                                         (401, Unauthenticated), (403, PermissionDenied),
                                         (429, ResourceExhausted), (413, PayloadTooLarge),
                                         (500, CloudUnavailable), (503, CloudUnavailable), (502, CloudUnavailable)])
def test_http_status_maps_to_error_type(status: int, cls: type[SpecSplitError]) -> None:
    body = json.dumps({"error": {"code": "x", "message": "boom"}}).encode()
    err = error_from_http(status, body)
    assert isinstance(err, cls) and err.message == "boom"


def test_http_500_internal_is_the_clouds_fault_and_not_retried() -> None:
    body = json.dumps({"error": {"code": "internal", "message": "internal error: RuntimeError",
                                 "error_id": "ab12"}}).encode()
    err = error_from_http(500, body)
    assert isinstance(err, Internal) and err.details["error_id"] == "ab12" and not is_retryable(err)


def test_http_409_keeps_expected_ctx_len() -> None:
    body = json.dumps({"error": {"code": "failed_precondition", "message": "m", "expected_ctx_len": 17}}).encode()
    err = error_from_http(409, body)
    assert isinstance(err, ContextMismatch) and err.details["expected_ctx_len"] == 17


def test_http_error_with_unreadable_body_still_maps() -> None:
    err = error_from_http(502, b"<html>bad gateway</html>")
    assert isinstance(err, CloudUnavailable) and "bad gateway" in err.message


@pytest.mark.parametrize("code, cls", [(grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
                                       (grpc.StatusCode.NOT_FOUND, NotFound),
                                       (grpc.StatusCode.FAILED_PRECONDITION, ContextMismatch),
                                       (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
                                       (grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
                                       (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
                                       (grpc.StatusCode.DEADLINE_EXCEEDED, CloudTimeout),
                                       (grpc.StatusCode.UNAVAILABLE, CloudUnavailable)])
def test_grpc_code_maps_to_error_type(code: grpc.StatusCode, cls: type[SpecSplitError]) -> None:
    assert isinstance(error_from_grpc(code, "boom"), cls)


def test_grpc_internal_is_the_clouds_fault_only_with_its_error_body() -> None:
    """The verifier's INTERNAL carries its error body and is not retried; an INTERNAL without one is the
    connection breaking under the call (a proxy's RST_STREAM when the replica died mid-stream): retried."""
    body = json.dumps({"error": {"code": "internal", "message": "boom", "error_id": "e1"}})
    assert type(error_from_grpc(grpc.StatusCode.INTERNAL, "boom", (("specsplit-error", body),))) is Internal
    dropped = error_from_grpc(grpc.StatusCode.INTERNAL, "Stream removed (RST_STREAM with error code 2)")
    assert isinstance(dropped, CloudUnavailable) and is_retryable(dropped)


def test_grpc_expected_ctx_len_from_json_details_metadata_or_message() -> None:
    body = json.dumps({"error": {"code": "failed_precondition", "message": "m", "expected_ctx_len": 5}})
    assert error_from_grpc(grpc.StatusCode.FAILED_PRECONDITION, body).details["expected_ctx_len"] == 5
    md = (("expected_ctx_len", "6"),)
    assert error_from_grpc(grpc.StatusCode.FAILED_PRECONDITION, "m", md).details["expected_ctx_len"] == 6
    err = error_from_grpc(grpc.StatusCode.FAILED_PRECONDITION, "ctx_len 9 != expected_ctx_len=7")
    assert err.details["expected_ctx_len"] == 7


def test_grpc_resource_exhausted_for_size_is_payload_too_large() -> None:
    body = json.dumps({"error": {"code": "payload_too_large", "message": "body too large"}})
    assert isinstance(error_from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, body), PayloadTooLarge)


def test_which_errors_are_retried() -> None:
    assert is_retryable(ResourceExhausted("x")) and is_retryable(CloudUnavailable("x"))
    assert is_retryable(PayloadTooLarge("x")) and is_retryable(SpecSplitError("internal"))
    assert is_retryable(Unavailable("draining"))
    for err in (InvalidArgument("x"), NotFound("x"), ContextMismatch("x"), Unauthenticated("x"), CloudTimeout("x"),
                Internal("internal error: RuntimeError", error_id="abc")):
        assert not is_retryable(err)


def test_grpc_details_from_the_clouds_trailing_error_body() -> None:
    body = json.dumps({"error": {"code": "failed_precondition", "message": "m", "expected_ctx_len": 11}})
    err = error_from_grpc(grpc.StatusCode.FAILED_PRECONDITION, "m", (("specsplit-error", body),))
    assert isinstance(err, ContextMismatch) and err.details["expected_ctx_len"] == 11
    size = json.dumps({"error": {"code": "payload_too_large", "message": "big"}})
    assert isinstance(error_from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "big", (("specsplit-error", size),)),
                      PayloadTooLarge)


def test_error_body_without_a_status_maps_by_code() -> None:
    from edge.transport.errors import error_from_body

    assert isinstance(error_from_body({"error": {"code": "resource_exhausted", "message": "busy"}}), ResourceExhausted)
    assert isinstance(error_from_body({"error": {"code": "not_found", "message": "x"}}), NotFound)
    assert isinstance(error_from_body({"oops": 1}), CloudUnavailable)
