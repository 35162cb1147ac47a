"""Schemathesis over the service's OpenAPI schema (a real uvicorn over Postgres): whatever it
sends, valid or not, no 5xx and no response that violates the schema."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.config import SchemathesisConfig

from support.fleet import reset_fleet_tables

# what uvicorn's HTTP parser answers, before the API sees the request, to one it cannot parse
# (schemathesis's extra headers can be malformed: `content-length: 0/0`)
UNPARSABLE = b"Invalid HTTP request received."


@schemathesis.check
def api_content_type_conformance(ctx, response, case):
    """schemathesis's content-type check, for the API's answers: the HTTP server's plain-text 400
    to a request it could not parse never reached the API, whose schema does not describe it."""
    if response.status_code == 400 and response.content == UNPARSABLE:
        return None
    return content_type_conformance(ctx, response, case)


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    api_content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
    ignored_auth,
]


@pytest.fixture(scope="module")
def api_schema(fleet):
    reset_fleet_tables(fleet.db_url)
    # 413 (body over the size limit) is as much a rejection of bad data as a 422
    config = SchemathesisConfig.from_dict(
        {
            "checks": {
                "negative_data_rejection": {
                    "expected-statuses": [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429]
                }
            }
        }
    )
    return schemathesis.openapi.from_url(f"{fleet.url}/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_5xx_and_no_schema_violation(case, fleet):
    # an admin token reaches every route's body; ignored_auth also tries each one without it
    case.call_and_validate(headers={"Authorization": f"Bearer {fleet.tokens['admin']}"}, checks=CHECKS)
