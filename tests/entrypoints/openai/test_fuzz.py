"""A bounded property-based fuzz (schemathesis on the server's own /openapi.json) finds no
5xx on any route. It runs against a tiny random model with SmolLM2's tokenizer and a 128-token
context, so each generated request costs milliseconds."""
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from tests.entrypoints.openai.conftest import LiveServer, start_tiny_engine
from tokenmill.entrypoints.openai.server import build_app

pytestmark = pytest.mark.e2e
schema = schemathesis.pytest.from_fixture("fuzz_schema")


@pytest.fixture(scope="module")
def fuzz_server(tiny_chat_model_dir):
    engine = start_tiny_engine(tiny_chat_model_dir)
    with LiveServer(build_app(engine, "tiny", max_body_bytes=256 * 1024)) as live:
        yield live
    engine.stop()


@pytest.fixture
def fuzz_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    case.call_and_validate(checks=[not_a_server_error], timeout=60)
