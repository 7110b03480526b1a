"""Bearer-key authentication: a guard (it runs before the body is read, so a bad key is a
401 whatever the body holds) that also spends one request from the tenant's rate limit."""
from __future__ import annotations

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from gateway.errors import GatewayError
from gateway.tenants import Tenant

CHALLENGE = {"WWW-Authenticate": 'Bearer realm="sluice"'}


def bearer_key(authorization: str | None) -> str:
    if not authorization:
        raise GatewayError(401, "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key",
                           headers=CHALLENGE)
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise GatewayError(401, "malformed Authorization header: expected 'Bearer <key>'",
                           code="invalid_api_key", headers=CHALLENGE)
    return key.strip()


def authenticate(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    gateway = connection.app.state.gateway
    key = bearer_key(connection.headers.get("authorization"))
    tenant = gateway.tenants.authenticate(key)
    if tenant is None:
        raise GatewayError(401, "unknown API key", code="invalid_api_key", headers=CHALLENGE)
    connection.state.tenant = tenant      # for the handler, and the metrics middleware labels by it
    gateway.rates.take_request(tenant)


def current_tenant(request: ASGIConnection) -> Tenant:
    """Dependency for handlers behind the guard."""
    return request.state.tenant
