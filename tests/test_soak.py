"""A short run of the soak (`make soak` runs a minute): mixed faults end cleanly and leak nothing."""

import pytest

from loadtest import soak


@pytest.mark.timeout(120)
def test_short_soak_ends_every_request_cleanly_and_in_time() -> None:
    result = soak.run(duration_s=5, concurrency=20)
    assert result["requests"] > 100
    assert result["not_clean"] == {}
    assert result["slowest_s"] <= result["limit_s"]
    assert not result["leaked"], result["runtime"]
    assert result["outcomes"]["ok"] > 0 and result["outcomes"]["clean_error"] > 0
