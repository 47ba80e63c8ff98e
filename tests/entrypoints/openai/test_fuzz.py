"""A bounded property-based fuzz (schemathesis on the server's own /openapi.json) finds no
5xx on any route. It runs against a tiny random model with SmolLM2's tokenizer and a 64-token
context, so each request is short. The quick run fuzzes only; the slow one adds schemathesis'
coverage phase (boundary and invalid values for every field, ~1000 requests)."""
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig

from tests.entrypoints.openai.conftest import LiveServer, start_tiny_engine
from tokenmill.entrypoints.openai.server import build_app

pytestmark = pytest.mark.e2e
quick = schemathesis.pytest.from_fixture("quick_schema")
full = schemathesis.pytest.from_fixture("full_schema")


@pytest.fixture(scope="module")
def fuzz_server(tiny_chat_model_dir):
    engine = start_tiny_engine(tiny_chat_model_dir)
    with LiveServer(build_app(engine, "tiny", max_body_bytes=256 * 1024)) as live:
        yield live
    engine.stop()


def _schema(server, phases: dict):
    config = SchemathesisConfig.from_dict({"phases": phases, "seed": 1234})
    return schemathesis.openapi.from_url(server.url + "/openapi.json", config=config)


@pytest.fixture
def quick_schema(fuzz_server):
    return _schema(fuzz_server, {"coverage": {"enabled": False},
                                 "examples": {"enabled": False}})


@pytest.fixture
def full_schema(fuzz_server):
    return _schema(fuzz_server, {})


@quick.parametrize()
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_fuzz_no_server_errors(case):
    case.call_and_validate(checks=[not_a_server_error], timeout=60)


@pytest.mark.slow
@full.parametrize()
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_fuzz_with_coverage_phase_no_server_errors(case):
    case.call_and_validate(checks=[not_a_server_error], timeout=60)
