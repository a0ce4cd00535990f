"""Schemathesis against the app's own OpenAPI schema: every operation, positive and negative
data, with the checks not_a_server_error, response_schema_conformance and negative_data_rejection.
Bounded by examples (and a fixed seed) so CI time stays predictable."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from tests.reliability.conftest import live_server

CHECKS = "not_a_server_error,response_schema_conformance,negative_data_rejection"
# Every warning counts as an issue except four that say nothing about the server: run and view
# ids are only ever fuzzed unknown, so their routes answer 404 (missing test data) and /export by
# view id accepts few requests (low valid rate); schemathesis has no deserializer for the
# streamed application/x-ndjson of /generate (tested in test_generate_stream.py instead); and
# /experiments/change-token rightly refuses most schema-valid bodies on the char-level default
# model, which has no mask or unknown token (validation mismatch). The three checks still run on
# every operation.
WARNINGS = ",".join(
    [
        "missing_auth", "base_url_mismatch", "unused_openapi_auth", "unsupported_regex",
        "method_not_allowed", "unmatched_filter", "unresolvable_reference", "rate_limited",
        "dictionary_mismatch",
    ]
)


@pytest.mark.slow
def test_schemathesis_finds_nothing_on_any_operation(tmp_path):
    # tiny-gpt first, so that the default model is a causal LM and /generate is fuzzed past its 422.
    with live_server(models={"tiny-gpt": "tiny-gpt", "minilm": "minilm"}) as server:
        schema = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
        operations = sum(len(methods) for methods in schema["paths"].values())
        assert operations >= 7
        result = subprocess.run(
            [
                sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
                "--checks", CHECKS, "--mode", "all", "--phases", "examples,coverage,fuzzing",
                "--max-examples", "40", "--seed", "1", "--workers", "1", "--no-color",
                "--generation-database", "none", "--request-timeout", "60", "--suppress-health-check", "too_slow", "--warnings", WARNINGS,
            ],
            cwd=tmp_path, capture_output=True, text=True, timeout=600,
        )
        report = result.stdout + result.stderr
        assert result.returncode == 0, report[-6000:]
        assert re.search(rf"Tested:\s+{operations}\b", report), report[-3000:]
        assert "No issues found" in report, report[-3000:]
        # The server is still healthy after the fuzzing.
        assert httpx.get(f"{server.url}/readyz", timeout=30).status_code == 200
